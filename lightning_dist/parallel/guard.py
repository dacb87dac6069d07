"""The non-finite guard: an optimizer step whose gradient norm is NaN or Inf is never applied.

The norm is taken over every axis after the last micro batch's backward, so every rank sees the same value and
takes the same decision without another collective. A NaN loss makes a NaN gradient, so the loss is covered too.
``stop`` (the default) ends the run with one line naming the step and the values; nothing of that step is applied
or saved, so the newest checkpoint is still a good one. ``skip`` drops the update and trains on (the step still
counts, for the LR schedule and ``max_steps``, as a skipped fp16 loss-scaler step does).

Where the host never waits: with an optimizer whose ``step()`` honours ``found_inf`` (torch's fused kernels,
``AdamW(fused=True)``; see :func:`lightning_dist._compat.step_supports_found_inf`) the decision is taken on the
device, as ``torch.amp.GradScaler`` skips a step: ``optimizer.found_inf = (~isfinite(norm)).float()`` and the kernel
leaves parameters, moments and the step counter as they were. Nothing is read on the host then; the device counts
non-finite steps and keeps the first one's step, norm and loss, and :meth:`NonFiniteGuard.report` reads that on
logging steps (``global_step % trainer.log_every_n_steps == 0``), before every checkpoint save and at the end of
training. So a non-finite step is reported at most ``log_every_n_steps - 1`` steps after it, naming its own step.
Under ``stop`` every update from the first non-finite step on is skipped on the device, so the weights at the error
are those before it. Any other optimizer (``foreach`` / for-loop AdamW, an fp16 ``GradScaler`` of its own) keeps
the host read: one device-to-host sync per optimizer step, the error or warning at the step itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_dist import _compat
from lightning_dist.errors import NONFINITE_ACTIONS, NonFiniteError

_ADVICE = "Lower optim.lr or raise the warmup, or set resilience.on_nonfinite=skip to drop such steps."


def nonfinite_message(step: int, norm: float, loss_text: str, note: str = "") -> str:
    """The one line of a :class:`NonFiniteError` (``note``: where a device-side decision was reported)."""
    return (
        f"step {step}: gradient norm {norm} (loss {loss_text}) is not finite; the update was not applied{note} and "
        f"nothing of this step was saved. {_ADVICE}"
    )


def allow_step(norm: Tensor, loss: Any, action: str, step: int, warn: Callable[[str], None]) -> bool:
    """Whether the optimizer may apply step ``step``'s gradients, decided on the host (one read of ``norm``).

    Raises:
        NonFiniteError: The norm is not finite and ``action`` is ``stop``.
    """
    if bool(torch.isfinite(norm)):
        return True
    if hasattr(loss, "full_tensor"):
        loss = loss.full_tensor()
    loss_text = f"{float(loss):.6g}" if isinstance(loss, Tensor) else "-"
    if action == "skip":
        warn(f"step {step}: gradient norm {float(norm)} (loss {loss_text}); the update was skipped.")
        return False
    raise NonFiniteError(nonfinite_message(step, float(norm), loss_text))


class NonFiniteGuard:
    """One strategy's guard: decides each optimizer step (on the device where the optimizer can) and reports.

    Args:
        action: ``stop`` or ``skip`` (``resilience.on_nonfinite``).
        warn: Where a skip is said (the strategy's: rank 0 only); ``warnings.warn`` by default.

    Raises:
        ValueError: An unknown ``action`` (one line).
    """

    def __init__(self, action: str = "stop", warn: Callable[[str], None] | None = None) -> None:
        if action not in NONFINITE_ACTIONS:
            raise ValueError(f"on_nonfinite={action!r} is unknown; use stop (end the run) or skip (drop such steps).")
        self.action = action
        self.warn = warn or (lambda message: warnings.warn(message, stacklevel=3))
        self.skipped = 0  #: updates the device skipped that were reported so far (``skip``)
        self._count: Tensor | None = None  # non-finite steps since the last report (device, int64)
        self._first_step: Tensor | None = None  # the first of them (device, int64)
        self._first_values: Tensor | None = None  # its [norm, loss, whether the loss is known] (device, float32)

    def optimizer_step(
        self,
        optimizer: Any,
        norm: Tensor,
        loss: Any,
        apply: Callable[[], Any],
        *,
        step: int,
        report: bool,
        on_device: bool,
    ) -> Any:
        """Run ``apply`` (the optimizer step) unless ``norm`` is not finite; returns its result or ``loss``.

        Args:
            optimizer: The optimizer (a Lightning wrapper's ``optimizer`` is taken).
            norm: The step's gradient norm over every axis (the same on every rank).
            loss: The step's loss, for the message.
            apply: The optimizer step.
            step: The optimizer step's number (1-based), for the message.
            report: A logging step: read the device's record now (:meth:`report`).
            on_device: The decision can be taken on the device (:meth:`decides_on_device`): nothing is read on the
                host, except when ``report``. Otherwise the norm is read here, every step.

        Raises:
            NonFiniteError: ``stop``, and a non-finite step was found (here, or on the device since the last report).
        """
        if getattr(optimizer, "optimizer", None) is not None:  # a LightningOptimizer
            optimizer = optimizer.optimizer
        if not on_device:
            if not allow_step(norm, loss, self.action, step, self.warn):
                optimizer.zero_grad(set_to_none=True)
                return loss
            return apply()
        optimizer.found_inf = self._record(norm, loss, step)
        try:
            result = apply()
        finally:
            del optimizer.found_inf
        if report:
            self.report(step)
        return result

    @staticmethod
    def decides_on_device(optimizer: Any, scaler: Any = None) -> bool:
        """Whether the step of ``optimizer`` can be skipped on the device (its kernel honours ``found_inf``, and no
        fp16 ``GradScaler`` sets it itself)."""
        if getattr(optimizer, "optimizer", None) is not None:
            optimizer = optimizer.optimizer
        return scaler is None and _compat.step_supports_found_inf(optimizer)

    def _record(self, norm: Tensor, loss: Any, step: int) -> Tensor:
        """Count a non-finite ``norm`` on the device; the ``found_inf`` to hand the optimizer (no host read)."""
        norm = norm.detach().float().reshape(())
        if self._count is None:
            self._count = torch.zeros((), dtype=torch.int64, device=norm.device)
            self._first_step = torch.zeros((), dtype=torch.int64, device=norm.device)
            self._first_values = torch.zeros(3, dtype=torch.float32, device=norm.device)
        if hasattr(loss, "full_tensor"):
            loss = loss.full_tensor()
        known = isinstance(loss, Tensor) and loss.numel() == 1
        loss = loss.detach().float().reshape(()).to(norm.device) if known else torch.zeros((), device=norm.device)
        bad = torch.logical_not(torch.isfinite(norm))
        first = torch.logical_and(bad, self._count == 0)
        self._first_step = torch.where(first, step, self._first_step)
        values = torch.stack([norm, loss, torch.ones_like(norm) if known else torch.zeros_like(norm)])
        self._first_values = torch.where(first, values, self._first_values)
        self._count += bad
        return (self._count > 0 if self.action == "stop" else bad).float()

    def report(self, step: int | None = None) -> int:
        """Read the device's count (one host read): raise under ``stop``, warn (rank 0) under ``skip``.

        Called on logging steps, before checkpoint saves and at the end of training. Returns the number of
        non-finite steps since the last report (0 without a device-side decision).

        Raises:
            NonFiniteError: ``stop``, and a step since the start was not finite (names that step).
        """
        if self._count is None:
            return 0
        count = int(self._count.item())
        if count == 0:
            return 0
        first_step = int(self._first_step.item())
        norm, loss, known = self._first_values.tolist()
        loss_text = f"{loss:.6g}" if known else "-"
        at = f", reported at step {step}" if step is not None else ""
        if self.action != "skip":
            note = f" (nor any after it: skipped on the device{at})"
            raise NonFiniteError(nonfinite_message(first_step, norm, loss_text, note))
        self._count.zero_()
        self.skipped += count
        self.warn(
            f"{count} update(s) skipped on the device since the last report{at}: the first at step {first_step}, "
            f"gradient norm {norm} (loss {loss_text})."
        )
        return count


def guard_of(strategy: Any) -> NonFiniteGuard | None:
    """``strategy``'s non-finite guard (our strategies), else ``None`` (Lightning's own)."""
    guard = getattr(strategy, "nonfinite_guard", None)
    return guard if isinstance(guard, NonFiniteGuard) else None

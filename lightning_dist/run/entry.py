"""The console scripts that need the app's packages (``pip install 'lightning-dist[app]'``): each checks them first.

The strategies, callbacks and telemetry need only torch, Lightning and the core dependencies; Hydra, W&B,
matplotlib and rich come with the ``app`` extra. Without it a script stops with one line naming what is missing and
the install command, instead of a traceback from deep in an import.
"""

from __future__ import annotations

import importlib.util
import sys

#: Import name -> the distribution that provides it (all in the ``app`` extra).
APP_PACKAGES = {
    "hydra": "hydra-core",
    "omegaconf": "omegaconf",
    "wandb": "wandb",
    "matplotlib": "matplotlib",
    "rich": "rich",
}


def require_app(script: str) -> None:
    """Exit with one line when a package of the ``app`` extra is missing."""
    missing = [dist for name, dist in APP_PACKAGES.items() if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(
            f"{script} needs {', '.join(missing)} (the app's extra); install it with: pip install 'lightning-dist[app]'"
        )


def train() -> None:
    """``lightning-dist-train``."""
    require_app("lightning-dist-train")
    from lightning_dist.run.train import main  # deferred: only once the app's packages are known to be there

    main()


def plan() -> None:
    """``lightning-dist-plan``."""
    require_app("lightning-dist-plan")
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:  # the app's own, not Hydra's (its *_schema groups)
        from lightning_dist.run.help import answer_help  # deferred: as above

        answer_help(sys.argv[1:], "lightning-dist-plan")
    from lightning_dist.plan.cli import main  # deferred: as above

    main()


def reproduce() -> None:
    """``lightning-dist-reproduce``."""
    require_app("lightning-dist-reproduce")
    from lightning_dist.run.reproduce import main  # deferred: as above

    main(sys.argv[1:])


def report() -> None:
    """``lightning-dist-report``."""
    require_app("lightning-dist-report")
    from lightning_dist.telemetry.report import main  # deferred: as above

    main(sys.argv[1:])

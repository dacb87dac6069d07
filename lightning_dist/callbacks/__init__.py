"""Lightning callbacks that keep a long run safe, for the app and for your own ``Trainer``: periodic, published
checkpoints (:class:`RunCheckpoints`), preemption signals (:class:`Preemption`) and hang detection
(:class:`Heartbeat`)."""

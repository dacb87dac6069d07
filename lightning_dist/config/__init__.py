"""The run's configuration: the typed schema Hydra composes (:mod:`.schema`), what a model config says without
building it (:mod:`.shapes`), the objects it builds (:mod:`.build`), and the one validation pass made before any
process starts (:mod:`.validate`)."""

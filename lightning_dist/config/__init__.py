"""The run's configuration: the typed schema Hydra composes (:mod:`.schema`), the objects it builds (:mod:`.build`),
and the one validation pass made before any process starts (:mod:`.validate`)."""

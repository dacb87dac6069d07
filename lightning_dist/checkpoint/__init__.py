"""Where a run's state is kept: sharded checkpoints (:mod:`.store`), weights read into any layout and HuggingFace
names (:mod:`.weights`), and export to one file or a HuggingFace folder (:mod:`.export`)."""

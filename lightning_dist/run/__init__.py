"""A run from the command line to its report: the Hydra entry point (:mod:`.train`), the ranks it launches
(:mod:`.launch`), what each rank runs (:mod:`.fit`), what a run returns (:mod:`.result`), and where they run
(:mod:`.cluster`, :mod:`.slurm`)."""

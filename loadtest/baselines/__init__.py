"""CPU baseline servers with the ranker's request contract (see :mod:`loadtest.baselines.app`)."""

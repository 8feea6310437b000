"""CPU baseline servers with the ensemble's request contract (see :mod:`loadtest.baselines.app`)."""

"""The in-process scorer: a release's chain loaded and run in this process (``pipeline``), its models
and blend as direct kernel calls (``chain``) and ranking requests over it (``ranking``). Below both the
server and the clients: Triton's models call it, and so do ``ensemble score --local``, the CPU baselines,
the demo and a deploy's parity check."""

"""What runs inside Triton's process: the native backend's Python side (``embedded``), the python
backend's models (``model``, ``rank_model``), a call's requests and answers (``calls``) and the ranker's
admission policy (``admission``; its C twin ``ensemble.native._admission`` serves, this one is the oracle
the tests hold it to and the policy of a build without C)."""

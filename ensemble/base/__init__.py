"""What every layer may use: the machine (``machine``: CPU, Debian packages, free ports; standard library only,
run by the system Python before the venv exists), device choice (``device``), the frameworks' console lines
(``console``), how grpc is imported (``grpc_polling``), tool pins (``pins``) and model sizes (``model_size``)."""

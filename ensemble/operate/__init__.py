"""The operator's side of one server: starting tritonserver (``server``), supervising and healing it
(``supervise``, ``processes``, ``allocator``, ``lifecycle``), the door in front of an exposed one (``door``),
model control and the admin key (``control``), releases declared and deployed (``declared``, ``deploy``) and
the metrics an operator reads (``monitoring``). Nothing here runs inside Triton's process."""

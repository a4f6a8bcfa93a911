"""Planning for GPUs without one: compile-only GPU targets, a compiled step's memory and time, and
whether a run fits (``python -m jaxrm.plan``)."""

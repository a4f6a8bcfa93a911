"""jaxrm's rewards in other RL frameworks' own calling conventions (``jaxrm.integrations.verl``)."""

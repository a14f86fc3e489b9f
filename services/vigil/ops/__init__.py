"""Every operator command (``vigil tokens``, ``vigil runs``, ``vigil dead``, ...): one module
per subject, each with a ``commands`` list that ``vigil.cli`` names. The services keep only
their start commands (``vigil ingest``, ``vigil worker``, ...) in their own packages.

Above the services in the layers: a command may read a service's rules (the token hash,
the timer parser, the dispatcher's operator functions), never the other way round.
"""

"""Instances as Ray actors: the cluster core stays in the serving process, each instance's
engine runs in an actor on the node Ray places it on (``talaria serve --ray``)."""

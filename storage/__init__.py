"""How tiergate keeps state on disk, shared by the packages that keep some (``batch``, ``accounts``)
and importing nothing of tiergate's, so that neither of them imports the other."""

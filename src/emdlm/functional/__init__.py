"""Pure tensor functions: the reference implementation of every objective.

Each module holds one objective with its formula and source in the docstring. The modules in
:mod:`emdlm.losses` wrap them; the fast paths in :mod:`emdlm.ops` are tested equal to them.
"""

"""Weight sharing between the training and rollout TP layouts.

``plan`` decides per rollout tensor (view, strided_view, local_rebuild, gather), ``materialize``
builds a rollout rank's tensors from the local training shards, ``ipc`` hands them to the rollout
process as handles with a shared weights-version counter, ``report`` prints the plan table
(``rollplex-plan sharing``). Layout specs live in ``models/layouts.py``; see ``docs/sharing.md``.
"""

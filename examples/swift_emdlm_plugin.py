"""ms-swift ``--external_plugins`` file: registers the emdlm losses as ``--loss_type`` names.

    swift sft --model <folder> --dataset <data.jsonl> \
        --external_plugins examples/swift_emdlm_plugin.py --loss_type emdlm_ntil ...

Every registered objective becomes ``emdlm_<name>`` with its defaults; add named variants with
their own parameters (the ``objective:`` section of an ``emdlm train`` config) below.
"""

from emdlm.integrations.swift import register_losses

register_losses()  # emdlm_ce, emdlm_ntil, emdlm_emd, emdlm_emo, ...
register_losses({
    "emdlm_ntil_stable": {"objective": {"name": "ntil", "params": {"preset": "stable"}}},
    "emdlm_ntil_from_hidden": {"objective": {"name": "ntil", "params": {"preset": "stable"}},
                               "from_hidden": True},
})  # fmt: skip

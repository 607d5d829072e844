"""Readers for the checkpoint layouts RL trainers write, all behind the lazy ``Checkpoint`` view.

``layouts.open_layout`` recognises a folder (docs/inputs.md lists every layout, how it is detected, and the
command that converts the ones rlmerge refuses); ``verl`` reads FSDP actor shards in place and ``lora``
turns a PEFT adapter into task vectors block by block.
"""

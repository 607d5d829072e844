"""Everything that touches files: the readers of every input layout, mapped views, the writer, the output rules.

``open.open_one`` resolves a folder or hub id and picks the reader for its layout (``layouts.detect``;
docs/inputs.md lists every layout, how it is detected, and the command that converts the ones rlmerge
refuses): ``checkpoint`` reads Hugging Face folders, ``verl`` FSDP actor shards in place, ``lora`` turns a PEFT
adapter into task vectors block by block. ``partial`` says where rlmerge may write and proves what it wrote;
``writer`` streams the output shards.
"""

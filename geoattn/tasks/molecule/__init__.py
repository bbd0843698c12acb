"""The ``molecule`` task (MD17-style energies and forces): the data builder and file format (``data``),
the networks (``models``) and the task (``task``). Submodules import their optional packages (RDKit,
ASE, tblite; MACE and SchNetPack for the peers) only when used."""

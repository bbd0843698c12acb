"""geoattn: geometric attention for PyTorch.

Layers by abstraction, imports pointing down:

    algebra    pure maths: Clifford algebras, the shared RoPE-style pair rotation
    rt         the RT-SDE model and its closed-form precision
    attention  functional kernels: rt_attention, rotor_attention (reference and fast paths)
    layers     nn.Modules built on the kernels
    models     whole networks (language models, RotorTransformer)
    tasks      data and metrics (lm, filter, nbody)
    training   the one trainer, checkpoints, plots, DDP
    bench      `geoattn bench ...` measurements
    cli        the `geoattn` command
"""

__version__ = "0.1.0"

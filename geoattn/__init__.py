"""geoattn: geometric attention for PyTorch.

Layers by abstraction, imports pointing down:

    core         errors, typed settings, optional extras, the cache folder: shared by every layer
    native       the C++ CPU kernels and their build
    algebra      pure maths: Clifford algebras, the shared RoPE-style pair rotation
    rt           the RT-SDE model and its closed-form precision
    attention    functional kernels: rt_attention, rotor_attention (reference and fast paths)
    layers       nn.Modules built on the kernels
    models       whole networks (language models, RotorTransformer)
    tasks        data and metrics (lm, filter, nbody, molecule, pointcloud, series)
    training     the one trainer, checkpoints, plots, DDP, recipes under configs
    bench        `geoattn bench ...` measurements
    hf           `geoattn export` and the Hugging Face model classes
    experiments  resumable grids of runs and their reports
    cli          the `geoattn` command and `geoattn quickstart`
"""

__version__ = "0.1.0"

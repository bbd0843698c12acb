"""`geoattn bench NAME`: each module here exposes ``add_arguments(parser)`` and ``run(args) -> int``."""

BENCHMARKS = {
    "algebra": "geoattn.bench.algebra",
    "attention": "geoattn.bench.attention",
    "rotor": "geoattn.bench.rotor",
    "lm": "geoattn.bench.lm",
    "molecule": "geoattn.bench.molecule",
    "train": "geoattn.bench.train",
    "step": "geoattn.bench.step",
}

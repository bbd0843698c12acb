"""The helpers every layer may use; none imports anything of geoattn outside this folder.

errors.py      UserError and its kinds (config, data, checkpoint), NativeBuildError: the errors a user reads
settings.py    typed settings from user-written options (unknown keys named, valid ones listed)
extras.py      optional dependencies: a missing extra is a one-line hint
formatting.py  plain-text output shared by the command line, benchmarks and reports
compile.py     what the kernels and the trainer share about torch.compile
subnormals.py  subnormal floats flushed to zero on the CPU
cache.py       the one cache folder (downloads, computed data, native builds)
"""

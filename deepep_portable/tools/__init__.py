"""The command-line tools (`python -m deepep_portable bench | doctor | precompile`) and what they need
beside the library: benchmark kernels, timing, ceilings, the local-rank launcher."""

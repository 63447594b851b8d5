"""DeepEP V2's `deep_ep.buffers`: `legacy` (V1's `Buffer`) and `elastic` (V2's `ElasticBuffer`), both over
the same transports and engines."""

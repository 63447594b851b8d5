"""Engines: the host side of each kernel family (parameters, launches, error decoding), standing on a
window; the transports compose them (one engine per mode)."""

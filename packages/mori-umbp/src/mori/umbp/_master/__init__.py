"""The UMBP master (control plane): private modules behind ``mori-umbp-master`` and
:class:`mori.umbp.MasterClient`."""

try:
    import grpc  # noqa: F401
except ImportError as e:  # say which extra brings it, rather than only what is missing
    raise ImportError("mori.umbp's cluster needs gRPC: pip install 'mori-umbp[grpc]'") from e

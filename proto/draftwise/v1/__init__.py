"""Generated Python code of the draftwise gRPC contract (package ``draftwise.v1``).

The ``*_pb2*.py`` / ``*_pb2.pyi`` files next to this one are made from the ``.proto`` files
here by ``python scripts/gen_proto.py``; do not edit them by hand.
"""

"""Generated gRPC stubs of ``draftwise.v1`` (GenerateService and its messages), vendored so
that the client needs neither the server package nor torch. Made by
``python clients/python/gen_stubs.py``; do not edit by hand.

The descriptors keep their proto file names (``draftwise/v1/*.proto``), byte for byte those
of the server package's ``draftwise.v1``, so both can be imported in one process.
"""

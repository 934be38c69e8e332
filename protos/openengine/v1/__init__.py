"""upb messages and grpclib stubs generated from the OpenEngine v0.1.0 protos (protos/generate.py)."""

"""Wire-contract tests of the generated OpenEngine v0.1.0 bindings (upb and betterproto2)."""

"""An OpenAI-compatible server over the built-in verifier (`specheads serve`)."""

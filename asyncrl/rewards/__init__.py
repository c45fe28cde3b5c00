"""Tasks and their verifiers."""

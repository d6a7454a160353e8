"""prfaas.proto and its generated stubs (regenerate with regenerate.sh beside them)."""

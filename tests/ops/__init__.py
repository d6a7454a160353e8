"""Op tests (a package, so its helpers get unique module names and need no conftest)."""

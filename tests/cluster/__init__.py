"""Tests over clusters of real processes (`ClusterProcesses`, `prfaas serve`, the CLI in a
subprocess); a package, so their module names stay unique beside tests/serving's."""

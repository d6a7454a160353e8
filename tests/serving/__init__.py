"""In-process tests of the serving plane: services on loopback gRPC over the fake engines, and
its pure parts; a package, so their module names stay unique beside tests/cluster's."""

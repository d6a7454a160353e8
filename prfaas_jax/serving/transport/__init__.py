"""What every serving process shares on the wire: the gRPC server setup, message validation,
mutual TLS and tokens, certificates, the inter-cluster link (shaper and kernel qdisc), the stall
watchdog and a serving process's own lifecycle (parent death, stop signals, its address file).
The state transfer built on it is `serving/transfer/`."""

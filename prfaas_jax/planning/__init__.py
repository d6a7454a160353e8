"""Planning glue: plan/simulation configs, reports and (later) the discrete-event simulator."""

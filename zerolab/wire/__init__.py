"""What goes on the wire: how each collective runs on this backend, and the bytes it writes.

- backends.py: what actually runs under zerolab's collectives (on gloo, an all-gather as N
  broadcasts, a reduce-scatter as send/recv pairs), recorded with every event;
- written.py: the bytes this process wrote to its sockets, as the kernel counts them;
- peers.py: the bytes sent to each other rank, per TCP connection (which link they crossed);
- torch_counter.py: torch's own collectives (DDP, ZeroRedundancyOptimizer, FSDP2), counted;
- trace.py: a recording as a Chrome/Perfetto trace;
- flight.py: the flight recorder, every rank's last collectives in a file that outlives it
  (zerolab.launch installs it in every rank; the launcher reads it when ranks hang or die);
  flight_torch.py records torch.distributed's functions called directly into it.

zerolab.comm issues and records every collective with these; nothing here imports comm.
"""

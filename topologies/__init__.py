"""Topologies and launchers for the THC BMv2 switch: network namespaces with veth pairs (``netns``),
a simple_switch_grpc process (``bmv2``), a Mininet star (``star``) and the worker runner (``worker``).
See docs/bmv2.md."""

"""The network side of the internode transport: `transport` (TransportConfig and the
striping plan over NIC ports and queue pairs) and `plan` (the planning model,
`python -m jax_ep.plan`)."""

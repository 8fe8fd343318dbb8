"""The mechanisms measured in process, one benchmark a file (`python -m tools.bench`)."""

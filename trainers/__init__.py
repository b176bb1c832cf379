"""What runs on the Ray cluster: launch entrypoint, train loop, built-in trainers, data, checkpoints,
telemetry.

`python -m trainers.launch` is the entrypoint the service submits as a Ray job; everything else here
is imported by it, on the driver or inside the Ray Train workers. Of the service, this package
imports only the modules both sides share, which need no SQLAlchemy, FastAPI or Ray:
`service.contract.spec` (the job spec), `service.contract.protocol` (launch request, telemetry, failure
reasons),
`service.contract.storage` (URIs, shard listing, manifests), `service.contract.webdataset` (the `.tar` codec)
and
`service.contract.errors`. It never touches the database (tests/unit/test_layering.py holds it to this).
"""

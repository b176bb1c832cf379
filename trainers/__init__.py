"""What runs on the Ray cluster: launch entrypoint, train loop, built-in trainers, data, checkpoints,
telemetry.

`python -m trainers.launch` is the entrypoint the service submits as a Ray job; everything else here
is imported by it, on the driver or inside the Ray Train workers. Of the service, this package
imports only the modules both sides share, which need no SQLAlchemy, FastAPI or Ray:
`service.spec` (the job spec), `service.protocol` (launch request, telemetry, failure reasons),
`service.storage` (URIs, shard listing, manifests), `service.webdataset` (the `.tar` codec) and
`service.errors`. It never touches the database (tests/unit/test_layering.py holds it to this).
"""

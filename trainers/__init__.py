"""What runs on the Ray cluster: launch entrypoint, train loop, models, data, checkpoints, reporting.

`python -m trainers.launch` is the entrypoint the service submits as a Ray job; everything else here
is imported by it, on the driver or inside the Ray Train workers. This package imports `service.spec`
(the shared job schema) and nothing else of the service.
"""

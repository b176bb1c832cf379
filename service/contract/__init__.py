"""What crosses a process boundary, shared by every side: the job spec, the launch request and the
telemetry protocol, the attempt's handoff in storage, storage URIs and the dataset formats, the queues'
configuration, job states and the typed errors.

The trainers (on the cluster) and the SDK import this package and the pure `service.planning.formulas`,
nothing else of `service`; nothing here imports the database, FastAPI, Ray or torch.
"""

"""Cluster math before and during a run: the pure formulas (`formulas`: memory, all-reduce, checkpoint
cadence, cost; importable by the trainers) and the inputs measured from the database and the cluster
(`measured`)."""

"""The process a worker runs in: device choice, CPU binding, the C heap mode, the scheduler slice of
communication threads, rendezvous, the worker launcher, what torchrun's elastic agent says
(restarts), and fault injection for the tests."""

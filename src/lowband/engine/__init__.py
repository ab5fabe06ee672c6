"""The Engine: hooks into backward and step, the non-finite gradient guard, and the stats it keeps.

It drives one algorithm (:mod:`lowband.algorithms`) and knows no specific one."""

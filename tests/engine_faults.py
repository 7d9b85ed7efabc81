"""Executors that fail on purpose, loaded by engine processes through the public
``--distributed-executor-backend module:Class`` flag (the child needs this repository on its
``PYTHONPATH``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from corefleet.engine.config import EngineConfig
from corefleet.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from corefleet.engine.worker.executor import UniProcExecutor
from corefleet.engine.worker.null_executor import NullExecutor

FAIL_AFTER_STEPS = 3
PID_FILE_ENV = "COREFLEET_TEST_PID_FILE"


class FailingExecutor(UniProcExecutor):
    """The real executor whose model runner raises inside ``execute_model`` after 3 steps."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        super().__init__(config, model_path)
        self.steps = 0
        real = self.runner.execute_model

        def execute_model(so: SchedulerOutput) -> ModelRunnerOutput:
            self.steps += 1
            if self.steps > FAIL_AFTER_STEPS:
                raise RuntimeError("injected failure inside execute_model")
            return real(so)

        self.runner.execute_model = execute_model  # type: ignore[method-assign]


class SlowStartExecutor(NullExecutor):
    """Writes the process id to ``$COREFLEET_TEST_PID_FILE``, then "loads" for a minute."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        super().__init__(config, model_path)
        Path(os.environ[PID_FILE_ENV]).write_text(str(os.getpid()))
        time.sleep(60)


class SlowNullExecutor(NullExecutor):
    """No model, but every step takes 10 ms: shutdown tests get a predictable amount of work
    in flight, however fast the machine is."""

    STEP_S = 0.01

    def _step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        time.sleep(self.STEP_S)
        return super()._step(so)

